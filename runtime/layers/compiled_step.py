"""The lean forward's decode step compiled by inductor, one graph per batch-size bucket.

A pure-decode step (one new token per sequence, every sequence sampled) has the same shape
every token except for its batch size and its longest context. This module turns that step —
embedding, 30-odd layers, the output head, up to the float32 logits — into one inductor graph:

- **Weights frozen.** :class:`DecodeGraph` holds every matrix as a buffer of one module, so
  inductor's ``freezing`` folds them into the graph as constants: float32 and bfloat16 linears
  get oneDNN/MKL prepacked weights once instead of a layout copy per call, and the int8 / int4
  kernels (``runtime/layers/weights.py``) are called directly with no Python between them.
- **Batch padded to a bucket.** The batch dimension is static: a step of B sequences runs the
  graph of the smallest bucket (1, 2, 4, 8, ...) that holds it, one graph each, compiled the first
  time its bucket is used. Padded rows write their K/V to the pool's scratch slot, which no
  sequence owns (``KVCache.scratch_slot``), and attend only to it.
- **Verification by (sequences, query length).** A speculating sequence computes its last
  token and its guesses in one step: Q query rows over one context. Its graph is bucketed by
  both (sequences S, queries per sequence Q), and gathers each sequence's context once for its
  Q rows. Gathering it per row, as a decode batch of S*Q rows would, read Q times the KV:
  at a 1,600-token context that outweighed the int4 weights of a verification step.
- **No guards on the graph's modules.** Dynamo guards every attribute and buffer of the
  modules a frame reads (about 2,700 checks for the default model), and evaluating them before
  each call cost 1.8 ms of a 12 ms int4 step (AMD EPYC). :class:`DecodeGraph` never changes after
  it is built (nothing replaces its weights or attributes), so only the guards on the step's
  own tensors — ids, positions, slots, the KV pool — are kept.
- **Context length dynamic.** The context dimension is marked dynamic, so a growing context
  reuses the bucket's graph. (Padding it to multiples of 64 with static graphs instead costs a
  recompile every 64 tokens and measured no faster per step; see the README.)

The K/V write happens inside the graph (``index_copy_`` into the pool's layer tensors, which
inductor performs in place), so the step is exactly the eager one: write, gather the context by
slot, attend with the GQA heads folded into the query axis.

Only a full-precision ("auto") KV pool is read this way; a quantized pool's reads plan staging
rows and dequantize blocks per step in Python (``runtime/kv/context.py``), so its steps stay eager.
"""

import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from runtime.kv.cache import KVCache
from runtime.layers.gemm import LINEAR, matmul
from runtime.layers.llama_forward import LlamaFamilyForward, Matrix
from runtime.layers.rescored_head import RescoredHead, rescored_logits
from runtime.layers.weights import ACTIVATION_DTYPE, Int4Weight, Int8Weight
from runtime.paths import cache_dir

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
# The longest context the dynamic dimension is declared for (inductor wants a bound).
MAX_CONTEXT = 1 << 20


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to the first one that holds ``max_num_seqs``."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def query_buckets(max_query: int) -> tuple[int, ...]:
    """Powers of two below ``max_query``, then ``max_query`` itself: a sequence verifying its
    most guesses (the usual case after a hit) pads no row."""
    return tuple(b for b in batch_buckets(max_query) if b < max_query) + (max_query,)


class PackedLinear(torch.nn.Module):
    """One weight matrix of the lean forward as buffers, multiplied as its format says."""

    weight: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, weight: Matrix, bias: torch.Tensor | None, chunks: dict[int, int] | None = None
    ) -> None:
        """``chunks``: a float weight's GEMM-plan form per batch bucket (absent: ``F.linear``)."""
        super().__init__()
        self.kind = "float"
        self.group_size = 0
        self.chunks = chunks or {}
        if isinstance(weight, Int8Weight):
            self.kind = "int8"
            self.register_buffer("qweight", weight.qweight)
            self.register_buffer("scales", weight.scales)
        elif isinstance(weight, Int4Weight):
            self.kind = "int4"
            self.group_size = weight.group_size
            self.register_buffer("qweight", weight.packed)
            self.register_buffer("scales", weight.scales_and_zeros)
        elif isinstance(weight, RescoredHead):
            self.kind = "rescored"
            self.rescored = weight  # which coarse pass each batch bucket takes, and how many candidates
            self.register_buffer("qweight", weight.coarse.qweight)
            self.register_buffer("scales", weight.coarse.scales)
            self.register_buffer("weight", weight.exact.detach())
        else:
            self.register_buffer("weight", weight.detach())
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "float":
            # The batch dimension is static, so the form is a constant of each bucket's graph:
            # weight-major products stream weights 2-3x as fast as F.linear on some CPUs (gemm.py).
            chunk = self.chunks.get(x.shape[0], LINEAR)
            if chunk != LINEAR:
                # One product, never chunks: inductor stored a chunked product's input row-major
                # (K, rows), which BLAS streams at about half the rate of the eager column-major view.
                chunk = max(chunk, x.shape[0])
            return matmul(x.to(self.weight.dtype), self.weight, self.bias, chunk)
        if self.kind == "rescored":
            head = self.rescored
            # x.shape[0] is static in each bucket's graph: the coarse pass is a constant of it.
            y = rescored_logits(
                x, self.qweight, self.scales, self.weight, head.uses_int8(x.shape[0]), head.num_candidates
            )
            return y if self.bias is None else y + self.bias
        x = x.to(ACTIVATION_DTYPE)
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.scales)
        return y if self.bias is None else y + self.bias


Forms = Callable[[Matrix], dict[int, int]]  # a weight -> its GEMM-plan form per batch bucket


class DecodeLayer(torch.nn.Module):
    input_norm_weight: torch.Tensor
    post_norm_weight: torch.Tensor

    def __init__(self, layer: Any, forms: Forms) -> None:
        super().__init__()
        self.register_buffer("input_norm_weight", layer.input_norm_weight.detach())
        self.input_norm_eps = layer.input_norm_eps
        self.qkv = PackedLinear(layer.qkv_weight, layer.qkv_bias, forms(layer.qkv_weight))
        self.o = PackedLinear(layer.o_weight, layer.o_bias, forms(layer.o_weight))
        self.register_buffer("post_norm_weight", layer.post_norm_weight.detach())
        self.post_norm_eps = layer.post_norm_eps
        self.gate_up = PackedLinear(layer.gate_up_weight, layer.gate_up_bias, forms(layer.gate_up_weight))
        self.down = PackedLinear(layer.down_weight, layer.down_bias, forms(layer.down_weight))


class DecodeGraph(torch.nn.Module):
    """The decode step over the lean forward's weights (shared, not copied) and a full KV pool."""

    embed_weight: torch.Tensor
    final_norm_weight: torch.Tensor

    def __init__(self, lean: LlamaFamilyForward, buckets: tuple[int, ...] = (1,)) -> None:
        super().__init__()

        def forms(weight: Matrix) -> dict[int, int]:
            if not isinstance(weight, torch.Tensor):
                return {}
            shape = (weight.shape[0], weight.shape[1])
            return {b: lean.gemm.forms_for(b).get(shape, LINEAR) for b in buckets}

        self.num_heads = lean.num_heads
        self.num_kv_heads = lean.num_kv_heads
        self.head_dim = lean.head_dim
        self.scaling = lean.scaling
        self.activation_dtype = lean.activation_dtype
        self.residual_dtype = lean.residual_dtype
        self.register_buffer("embed_weight", lean.embed_weight.detach())
        self.rotary = lean.rotary
        self.layers = torch.nn.ModuleList(DecodeLayer(layer, forms) for layer in lean.layers)
        self.register_buffer("final_norm_weight", lean.final_norm_weight.detach())
        self.final_norm_eps = lean.final_norm_eps
        self.head = PackedLinear(lean.lm_head_weight, lean.lm_head_bias, forms(lean.lm_head_weight))

    def forward(
        self,
        input_ids: torch.Tensor,  # (B,) = (S*Q,): each sequence's Q query rows in turn
        positions: torch.Tensor,  # (B,)
        slot_mapping: torch.Tensor,  # (B,) where each token's K/V goes
        context_slots: torch.Tensor,  # (S, L) each sequence's context, all its query tokens included
        context_mask: torch.Tensor,  # (S, Q, L) bool, True where a query row attends
        key_pool: list[torch.Tensor],  # per layer (KVH, slots, D)
        value_pool: list[torch.Tensor],
    ) -> torch.Tensor:
        """Logits (B, V) float32 for each row's next token."""
        batch = input_ids.shape[0]
        num_seqs, query, length = context_mask.shape
        rms_norm, rotate = LlamaFamilyForward._rms_norm, LlamaFamilyForward._rotate
        h = F.embedding(input_ids, self.embed_weight).to(self.residual_dtype)  # (B, hidden)
        cos, sin = self.rotary(h[None].to(self.activation_dtype), positions[None])  # (1, B, D) each
        cos, sin = cos[0, :, None], sin[0, :, None]  # (B, 1, D): broadcast over heads
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        groups = self.num_heads // self.num_kv_heads
        flat_slots = context_slots.reshape(-1)  # (S*L,)
        if query == 1:
            mask = context_mask[:, :, None, :]  # (S, 1, 1, L): the same for every query head
        else:  # (S, 1, Q*groups, L): query row j's mask for each of its heads
            mask = context_mask[:, :, None, :].expand(num_seqs, query, groups, length)
            mask = mask.reshape(num_seqs, 1, query * groups, length)
        for i, layer in enumerate(cast(list[DecodeLayer], self.layers)):
            x = rms_norm(h, layer.input_norm_weight, layer.input_norm_eps)
            q, k, v = layer.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
            q = rotate(q.view(batch, self.num_heads, self.head_dim), cos, sin)  # (B, H, D)
            k = rotate(k.view(batch, self.num_kv_heads, self.head_dim), cos, sin)  # (B, KVH, D)
            v = v.view(batch, self.num_kv_heads, self.head_dim)
            keys, values = key_pool[i], value_pool[i]
            keys.index_copy_(1, slot_mapping, k.transpose(0, 1).to(keys.dtype))
            values.index_copy_(1, slot_mapping, v.transpose(0, 1).to(values.dtype))
            # (KVH, S*L, D) -> (KVH, S, L, D)
            ck = keys.index_select(1, flat_slots).view(self.num_kv_heads, num_seqs, length, self.head_dim)
            cv = values.index_select(1, flat_slots).view(self.num_kv_heads, num_seqs, length, self.head_dim)
            # The query heads that share a KV head, and a sequence's query rows, fold into the
            # query axis, as in the eager decode (runtime/layers/attention.py): no repeated keys.
            q = q.to(ck.dtype).view(num_seqs, query, self.num_kv_heads, groups, self.head_dim)
            q = q.transpose(1, 2).reshape(num_seqs, self.num_kv_heads, query * groups, self.head_dim)
            o = F.scaled_dot_product_attention(
                q, ck.transpose(0, 1), cv.transpose(0, 1), attn_mask=mask, scale=self.scaling
            )  # (S, KVH, Q*groups, D)
            o = o.reshape(num_seqs, self.num_kv_heads, query, groups, self.head_dim).transpose(1, 2)
            h = h + layer.o(o.reshape(batch, q_size).to(self.activation_dtype))
            x = rms_norm(h, layer.post_norm_weight, layer.post_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)  # (B, I) each
            h = h + layer.down(F.silu(gate) * up)
        h = rms_norm(h, self.final_norm_weight, self.final_norm_eps)
        return self.head(h).float()  # (B, V)


@dataclass(slots=True)
class StepRows:
    """One sequence's rows in a compiled step: its last token, then any guesses."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    context: torch.Tensor  # (L,) slots of its context, all of this step's tokens included


@dataclass(slots=True)
class DecodeInputs:
    """One decode or verification step's tensors, padded to its (S, Q) shape."""

    input_ids: torch.Tensor  # (S*Q,)
    positions: torch.Tensor  # (S*Q,)
    slot_mapping: torch.Tensor  # (S*Q,)
    context_slots: torch.Tensor  # (S, L)
    context_mask: torch.Tensor  # (S, Q, L) bool
    rows: list[int]  # where each real row sits among the S*Q

    def real_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The real rows of the graph's (S*Q, V) logits, in the sequences' order."""
        n = len(self.rows)
        return logits[:n] if self.rows[-1] == n - 1 else logits[self.rows]  # a slice where none pads


@dataclass(slots=True)
class CompileReport:
    """What the compiled step has done so far, for the engine's stats."""

    enabled: bool  # still compiling/using graphs (False once a compile failed)
    compiled_buckets: tuple[int, ...] = ()  # decode graphs' batch buckets
    compiled_verify_shapes: tuple[tuple[int, int], ...] = ()  # verification graphs' (S, Q)
    num_compilations: int = 0  # graphs inductor built, recompiles included
    num_compiled_steps: int = 0
    compile_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # by (S, Q)
    notice: str | None = None  # why compilation turned itself off, if it did


def configure_inductor(cpp_wrapper: bool = False) -> dict[str, Any]:
    """Put inductor's cache under liubai's cache dir; return the settings for these graphs.

    The settings (weights frozen into the graph, the FX graph cache on) are patched per compile
    rather than set globally, so other ``torch.compile`` users in the process (a benchmark's
    peer) keep inductor's defaults. ``TORCHINDUCTOR_CACHE_DIR`` is inductor's own setting, read
    when it compiles; one the user set is left alone. Importing ``torch._dynamo`` (transformers
    does, before any engine compiles) writes inductor's default, a directory under /tmp, into the
    environment, so that value counts as unset: left there, every graph would compile again after
    a reboot.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(CACHE_DIR_ENV)
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_DIR_ENV] = str(cache_dir() / "inductor")
    return {"freezing": True, "cpp_wrapper": cpp_wrapper, "fx_graph_cache": True}


def _fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under a new code object: dynamo keeps its graphs (and its recompile limit) per code
    object, so each bucket gets a cache of its own and never evicts another's graph."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledDecodeStep:
    """Graphs of :class:`DecodeGraph` per (sequences, queries per sequence) bucket, compiled
    lazily, with an eager fallback.

    Decode steps have one query per sequence, batched up to ``max_num_seqs``; verification steps
    up to ``max_query`` (a sequence's token and its guesses) for at most ``max_verify_seqs``.
    ``on_notice`` hears each line worth a user's attention: a bucket's first compile starting
    (it takes a while) and finishing, and the one notice if compiling fails, after which every
    step runs eager.
    """

    def __init__(
        self,
        lean: LlamaFamilyForward,
        kv_cache: KVCache,
        max_num_seqs: int,
        on_notice: Callable[[str], None] | None = None,
        max_verify_seqs: int = 0,
        max_query: int = 1,
    ) -> None:
        if kv_cache.scratch_slot is None:
            raise ValueError("a compiled decode step needs a KV pool with a scratch slot")
        self.kv_cache = kv_cache
        self.scratch_slot = kv_cache.scratch_slot
        self.buckets = batch_buckets(max_num_seqs)
        self.verify_buckets = batch_buckets(max_verify_seqs) if max_verify_seqs > 0 and max_query > 1 else ()
        self.query_buckets = query_buckets(max_query) if self.verify_buckets else (1,)
        # Every graph's number of rows: each gets the GEMM plan's forms for that many.
        rows = set(self.buckets) | {s * q for s in self.verify_buckets for q in self.query_buckets}
        self.row_counts = tuple(sorted(rows))
        self.graph = DecodeGraph(lean, self.row_counts).eval()
        self.on_notice = on_notice
        self._compiled: dict[tuple[int, int], Callable[..., torch.Tensor]] = {}
        self._inductor_options: dict[str, Any] | None = None  # configured at the first compile
        self._report = CompileReport(enabled=True)

    def report(self) -> CompileReport:
        r = self._report
        return CompileReport(
            r.enabled,
            tuple(sorted(s for s, q in self._compiled if q == 1)),
            tuple(sorted(shape for shape in self._compiled if shape[1] > 1)),
            r.num_compilations,
            r.num_compiled_steps,
            dict(r.compile_seconds),
            r.notice,
        )

    @property
    def enabled(self) -> bool:
        return self._report.enabled

    @property
    def num_compilations(self) -> int:
        return self._report.num_compilations

    def bucket_for(self, num_seqs: int, query: int = 1) -> tuple[int, int] | None:
        """The (S, Q) graph shape that holds ``num_seqs`` sequences of up to ``query`` rows each."""
        seqs: tuple[int, ...]
        queries: tuple[int, ...]
        if query == 1:
            seqs, queries = self.buckets, (1,)
        else:
            seqs, queries = self.verify_buckets, self.query_buckets
        s = next((b for b in seqs if b >= num_seqs), None)
        q = next((b for b in queries if b >= query), None)
        return None if s is None or q is None else (s, q)

    def pad(self, seqs: list[StepRows]) -> DecodeInputs | None:
        """The step's sequences padded to their (S, Q) bucket; None where no graph holds them.

        Padded rows, of a real sequence or of a padded one, write their K/V to the scratch slot
        and attend to their context's first slot only: finite values, never read back.
        """
        shape = self.bucket_for(len(seqs), max(len(r.input_ids) for r in seqs))
        if shape is None:
            return None
        num_seqs, query = shape
        scratch = self.scratch_slot
        device = seqs[0].context.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lengths: list[list[int]] = []
        rows: list[int] = []
        for i, r in enumerate(seqs):
            n = len(r.input_ids)
            extra = query - n
            rows.extend(range(i * query, i * query + n))
            input_ids += r.input_ids + [0] * extra
            positions += r.positions + [0] * extra
            slots += r.slots + [scratch] * extra
            base = r.context.shape[0] - n  # the context before this step's first token
            lengths.append([base + j + 1 for j in range(n)] + [1] * extra)
        extra_seqs = num_seqs - len(seqs)
        input_ids += [0] * (query * extra_seqs)
        positions += [0] * (query * extra_seqs)
        slots += [scratch] * (query * extra_seqs)
        lengths += [[1] * query] * extra_seqs
        padding = torch.full((1,), scratch, dtype=torch.long, device=device)
        contexts = [r.context for r in seqs] + [padding] * extra_seqs
        # Past each sequence's length the scratch slot pads: finite storage the mask keeps out.
        context_slots = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True, padding_value=scratch)
        if context_slots.shape[1] < 2:  # a dynamic dimension must not specialise on 1
            context_slots = F.pad(context_slots, (0, 1), value=scratch)
        ends = torch.tensor(lengths, device=device)  # (S, Q)
        positions_l = torch.arange(context_slots.shape[1], device=device)
        mask = positions_l[None, None, :] < ends[:, :, None]  # (S, Q, L)
        return DecodeInputs(
            input_ids=torch.tensor(input_ids, device=device),
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            context_slots=context_slots,
            context_mask=mask,
            rows=rows,
        )

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        """Inductor with this step's settings, counting each graph it builds."""
        from torch._inductor.compile_fx import compile_fx

        self._report.num_compilations += 1
        return compile_fx(gm, example_inputs, config_patches=self._inductor_options)

    def __call__(self, inputs: DecodeInputs) -> torch.Tensor | None:
        """Logits (bucket, V) float32, or None when the step must run eager (compiling failed).

        Every call, not only a bucket's first, runs under the fallback: a later one can
        recompile (a guard on the context length failing) and fail the same ways. A failed
        compile raises before any kernel runs, so the pool is untouched and the eager retry of
        the same step is exact.
        """
        if not self._report.enabled:
            return None
        num_seqs, query, _ = inputs.context_mask.shape
        bucket = (num_seqs, query)
        fn = self._compiled.get(bucket)
        first = fn is None
        if fn is None:
            if self._inductor_options is None:
                self._inductor_options = configure_inductor()
            fn = torch.compile(
                _fresh_function(_run_graph),
                backend=self._backend,
                dynamic=False,
                fullgraph=True,
                options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
            )
            self._notice(f"compiling the {_step_name(num_seqs, query)} (once; cached on disk after)")
        torch._dynamo.mark_dynamic(inputs.context_slots, 1, min=2, max=MAX_CONTEXT)
        torch._dynamo.mark_dynamic(inputs.context_mask, 2, min=2, max=MAX_CONTEXT)
        args = (
            self.graph, inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.context_slots,
            inputs.context_mask, self.kv_cache.key_store.cache, self.kv_cache.value_store.cache,  # type: ignore[union-attr]
        )  # fmt: skip
        start = time.perf_counter()
        try:
            logits = fn(*args)
        except Exception as exc:  # inductor fails in many ways (no compiler, a build error); all mean eager
            self._report.enabled = False
            self._report.notice = f"decode steps run eager: compiling failed ({_first_line(exc)})"
            self._notice(self._report.notice)
            return None
        self._report.num_compiled_steps += 1
        if first:
            seconds = time.perf_counter() - start
            self._compiled[bucket] = fn
            self._report.compile_seconds[bucket] = seconds
            self._notice(f"compiled the {_step_name(num_seqs, query)} in {seconds:.1f} s")
        return logits

    def _notice(self, line: str) -> None:
        if self.on_notice is not None:
            self.on_notice(line)


def _step_name(num_seqs: int, query: int) -> str:
    if query == 1:
        return f"decode step for batch {num_seqs}"
    return f"verification step for {num_seqs} sequence{'s' if num_seqs > 1 else ''} of {query} tokens"


def _run_graph(graph: DecodeGraph, *tensors: Any) -> torch.Tensor:
    return graph(*tensors)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
