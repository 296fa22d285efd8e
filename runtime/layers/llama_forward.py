"""A lean forward pass for Llama-family decoders (Llama, Qwen2, Mistral without sliding windows).

The engine can run any transformers causal LM through the attention hook (``runtime/layers/attention.py``);
for the Llama family it runs this forward instead, because on a CPU a 135M-parameter model's
decode step is dominated by per-operation overhead, not arithmetic: transformers' module tree
spends roughly a third of each step in Python dispatch, decorators and keyword plumbing.

This forward calls the same torch operations in the same order on the same weights, with two
structural changes that cut calls: the q/k/v projections run as one matmul and the gate/up
projections as another. The fused weights are built once and the model's own ``nn.Linear``
modules are rebound to views of them, so memory is not duplicated and the transformers path
keeps working on the same storage. With ``F.linear`` its outputs are bit-identical to
transformers'. Each product is asked of BLAS in the form a :class:`GemmPlan` timed fastest on
this machine (``runtime/layers/gemm.py``), which changes only rounding; the tests assert tokens against
``generate()`` either way.

With a quantized weight format (``runtime/layers/weights.py``) the fused matrices are packed once,
from the weights as loaded (float32), and the model's own copies are released: only this forward
can run such a model. The output head becomes a bfloat16 matrix with an int8 copy for a coarse
first pass (``runtime/layers/rescored_head.py``). The products run in bfloat16; the residual
stream and the norms stay float32. Steps of many rows (prefill) multiply by bfloat16 copies of the
quantized matrices where this machine runs those faster (``runtime/layers/wide_steps.py``).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from runtime.layers.attention import METADATA_KWARG, AttentionMetadata, paged_attention_forward
from runtime.layers.gemm import LINEAR, GemmPlan, Shape, matmul, plan_for
from runtime.layers.rescored_head import RescoredHead
from runtime.layers.weight_cache import cached_quantize, weights_key
from runtime.layers.weights import (
    ACTIVATION_DTYPE,
    QUANTIZED_FORMATS,
    QuantizedWeight,
    quantize,
)
from runtime.layers.wide_steps import WideCopies, WideMatrix, build_wide_copies

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


def supports(model: Any) -> bool:
    """Whether ``model`` is a decoder this forward reproduces exactly."""
    return supports_config(model.config)


def supports_config(config: Any) -> bool:
    """Whether a model with this transformers config is one :func:`supports` accepts."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        return False
    return True


@dataclass(slots=True)
class _Layer:
    attention: torch.nn.Module  # passed to the attention function (it reads layer_idx)
    input_norm_weight: torch.Tensor
    input_norm_eps: float
    qkv_weight: "Matrix"  # (H*D + 2*KVH*D, hidden)
    qkv_bias: torch.Tensor | None
    o_weight: "Matrix"
    o_bias: torch.Tensor | None
    post_norm_weight: torch.Tensor
    post_norm_eps: float
    gate_up_weight: "Matrix"  # (2*I, hidden)
    gate_up_bias: torch.Tensor | None
    down_weight: "Matrix"
    down_bias: torch.Tensor | None
    # Bfloat16 copies of the four quantized matrices, for steps of many rows (wide_steps.py).
    wide: tuple[WideMatrix, WideMatrix, WideMatrix, WideMatrix] | None = None


Matrix = torch.Tensor | QuantizedWeight | RescoredHead
M = TypeVar("M")


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate weights (and biases) and rebind each module to its view of the result."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat(
            [
                lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features)
                for lin in linears
            ]
        )
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if lin.bias is not None and bias is not None:
            lin.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


def _by_layer(flat: Sequence[M]) -> list[tuple[M, M, M, M]]:
    """Matrices listed four per layer (qkv, o, gate_up, down), as one tuple per layer."""
    return [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4)]


def _release(linears: list[torch.nn.Linear]) -> None:
    """Drop the modules' weights once a packed copy holds them (an empty weight fails loudly if called)."""
    for lin in linears:
        lin.weight = torch.nn.Parameter(torch.empty(0, lin.in_features), requires_grad=False)


def _pack(
    model: Any, weights: str, tune_gemm: bool
) -> tuple[
    Matrix,
    list[tuple[Matrix, Matrix, Matrix, Matrix]],
    list[tuple[torch.Tensor | None, ...]],
    WideCopies | None,
]:
    """The output head, each layer's (qkv, o, gate_up, down) matrices and its (qkv, gate_up)
    biases, and the bfloat16 copies for wide steps (``wide_steps.py``; quantized formats only).

    Float formats fuse in place (the modules become views); quantized ones quantize the fused
    float32 weights (or read them back from ``weight_cache.py``), release the modules' copies
    and cast the rest of the model to bfloat16.
    """
    quantized = weights in QUANTIZED_FORMATS
    head: Matrix = model.lm_head.weight
    if quantized:  # two passes, coarse and exact (rescored_head.py); a tied head is the embedding
        exact = model.lm_head.weight.data = model.lm_head.weight.data.to(ACTIVATION_DTYPE)
        head = RescoredHead.build(exact, time_passes=tune_gemm)
    dense: list[torch.Tensor] = []  # each layer's qkv, o, gate_up, down
    biases: list[tuple[torch.Tensor | None, ...]] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_weight, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up_weight, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        dense += [qkv_weight, attn.o_proj.weight, gate_up_weight, mlp.down_proj.weight]
        biases.append((qkv_bias, gate_up_bias))
    packed: Sequence[Matrix] = dense
    wide = None
    if quantized:
        quantized_dense = cached_quantize(
            weights_key(dense, weights), len(dense), lambda: [quantize(w, weights) for w in dense]
        )
        packed = quantized_dense
        # Only with the GEMM plan on: the copies, like the plan, are a timed choice of form.
        wide = build_wide_copies(quantized_dense, dense, enabled=tune_gemm)
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
            _release([*linears, mlp.down_proj])
        embedding = model.model.embed_tokens.weight  # looked up row by row: precision, not speed
        embedding.data = embedding.data.to(ACTIVATION_DTYPE)  # a no-op where it is the tied head
        # Biases join the kernels' bfloat16 outputs, which must stay bfloat16 up to attention.
        for layer in model.model.layers:
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                if lin.bias is not None:
                    lin.bias.data = lin.bias.data.to(ACTIVATION_DTYPE)
        biases = [tuple(None if b is None else b.to(ACTIVATION_DTYPE) for b in pair) for pair in biases]
    return head, _by_layer(packed), biases, wide


class LlamaFamilyForward:
    def __init__(self, model: Any, tune_gemm: bool = True, weights: str | None = None) -> None:
        """Fuse ``model``'s projections; with ``tune_gemm``, plan each product's form for them.

        The plan is made here, not passed in, because it is timed on the fused weights this
        constructor builds. Without ``tune_gemm`` every product is ``F.linear``. ``weights`` is
        the weight format (None: the model's dtype as loaded); a quantized one packs the matrices
        and casts the rest of the model to bfloat16.
        """
        config = model.config
        self.weights = weights or str(model.lm_head.weight.dtype).removeprefix("torch.")
        self.lm_head_weight, matrices, biases, self.wide_copies = _pack(model, self.weights, tune_gemm)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.embed_weight = model.model.embed_tokens.weight
        self.rotary = model.model.rotary_emb
        self.final_norm_weight = model.model.norm.weight
        self.final_norm_eps = model.model.norm.variance_epsilon
        self.lm_head_bias = model.lm_head.bias
        self.layers: list[_Layer] = []
        copies = self.wide_copies
        wides = _by_layer(copies.matrices) if copies is not None else [None] * len(matrices)
        for layer, four, (qkv_bias, gate_up_bias), wide in zip(
            model.model.layers, matrices, biases, wides, strict=True
        ):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_weight, o_weight, gate_up_weight, down_weight = four
            self.layers.append(
                _Layer(
                    attention=attn,
                    input_norm_weight=layer.input_layernorm.weight,
                    input_norm_eps=layer.input_layernorm.variance_epsilon,
                    qkv_weight=qkv_weight,
                    qkv_bias=qkv_bias,
                    o_weight=o_weight,
                    o_bias=attn.o_proj.bias,
                    post_norm_weight=layer.post_attention_layernorm.weight,
                    post_norm_eps=layer.post_attention_layernorm.variance_epsilon,
                    gate_up_weight=gate_up_weight,
                    gate_up_bias=gate_up_bias,
                    down_weight=down_weight,
                    down_bias=mlp.down_proj.bias,
                    wide=wide,
                )
            )
        self.scaling = model.model.layers[0].self_attn.scaling
        # Packed weights have one kernel each; only float matrices have forms to choose between.
        quantized = self.weights in QUANTIZED_FORMATS
        # A quantized format multiplies in bfloat16 (its kernels' fast path) but keeps the residual
        # stream and the norms in float32: rounding the residual to bfloat16 after every layer
        # was most of the bfloat16 model's KL divergence from float32.
        self.activation_dtype = ACTIVATION_DTYPE if quantized else self.embed_weight.dtype
        self.residual_dtype = torch.float32 if quantized else self.embed_weight.dtype
        self.gemm = GemmPlan() if quantized else plan_for(self.matrices(), enabled=tune_gemm)  # type: ignore[arg-type]

    def matrices(self) -> list[Matrix]:
        """Every weight this forward multiplies by, for the GEMM plan to time."""
        per_layer = [(la.qkv_weight, la.o_weight, la.gate_up_weight, la.down_weight) for la in self.layers]
        return [w for ws in per_layer for w in ws] + [self.lm_head_weight]

    @property
    def wide_rows(self) -> int | None:
        """The fewest rows a step multiplies by the bfloat16 copies; None: always the kernels."""
        return None if self.wide_copies is None else self.wide_copies.min_rows

    def release_wide_copies(self) -> None:
        """Free the copies (another forward reads this model's long chunks): every step uses the kernels."""
        self.wide_copies = None
        for layer in self.layers:
            layer.wide = None

    def weight_bytes_per_token(self) -> int:
        """Bytes of matrices one decode step reads (all of them, the head included; embedding rows aside)."""
        return sum(w.nbytes for w in self.matrices())

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Exactly transformers' LlamaRMSNorm, op for op, so the result is bit-identical.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor,
        decode_kernels: bool = False,
    ) -> torch.Tensor:
        """Logits (len(keep), V) at packed positions ``keep``; ``input_ids``, ``position_ids``: (T,).

        A step of at least :attr:`wide_rows` rows multiplies by the bfloat16 copies, unless
        ``decode_kernels`` asks for the kernels decode steps use (to score the format itself).
        """
        num_tokens = input_ids.shape[0]
        wide = not decode_kernels and self.wide_rows is not None and num_tokens >= self.wide_rows
        h = F.embedding(input_ids, self.embed_weight).to(self.residual_dtype)  # (T, hidden)
        cos, sin = self.rotary(h[None].to(self.activation_dtype), position_ids[None])  # (1, T, D) each
        cos, sin = cos[0], sin[0]  # (T, D), broadcast over heads below
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        kwargs: dict[str, Any] = {METADATA_KWARG: meta}
        forms = self.gemm.forms_for(num_tokens)
        for layer in self.layers:
            qkv_weight, o_weight, gate_up_weight, down_weight = (
                layer.wide
                if wide and layer.wide is not None
                else (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
            )
            x = self._rms_norm(h, layer.input_norm_weight, layer.input_norm_eps)
            qkv = _linear(forms, x, qkv_weight, layer.qkv_bias)  # (T, (H + 2*KVH) * D)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim).transpose(0, 1)  # (H, T, D)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)  # (KVH, T, D)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)  # (KVH, T, D)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            attn, _ = paged_attention_forward(
                layer.attention, q[None], k[None], v[None], None, scaling=self.scaling, **kwargs
            )  # (1, T, H, D)
            h = h + _linear(forms, attn.reshape(num_tokens, q_size), o_weight, layer.o_bias)
            x = self._rms_norm(h, layer.post_norm_weight, layer.post_norm_eps)
            gate_up = _linear(forms, x, gate_up_weight, layer.gate_up_bias)
            gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
            h = h + _linear(forms, F.silu(gate) * up, down_weight, layer.down_bias)
        h = self._rms_norm(h[keep], self.final_norm_weight, self.final_norm_eps)  # (n, hidden)
        head_forms = self.gemm.forms_for(h.shape[0])  # the head multiplies only the sampled rows
        return _linear(head_forms, h, self.lm_head_weight, self.lm_head_bias)  # (n, V)


def _linear(
    forms: dict[Shape, int], x: torch.Tensor, weight: Matrix | WideMatrix, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` in the form the plan chose for this weight's shape, or a packed weight's kernel."""
    if isinstance(weight, torch.Tensor):
        return matmul(x, weight, bias, forms.get((weight.shape[0], weight.shape[1]), LINEAR))
    if isinstance(weight, RescoredHead):
        y = weight.matmul(x)  # its candidates are rescored from the float32 hidden state
    else:
        y = weight.matmul(x.to(ACTIVATION_DTYPE))  # a no-op where x is already bfloat16
    return y if bias is None else y + bias
