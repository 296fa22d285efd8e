"""KV-cache capacity planning: bytes per token, per session, and sessions per pool, before any load.

The planner reads only a model's shape (``config.json``, or a ``.gguf`` file's metadata; never
weights) and asks the runtime's own :class:`~runtime.kv.cache.KVLayout` and codecs for every
byte count, so its figures are the engine's by construction rather than a second copy of the
formula. That matters for quantized storage: int8 and int4 keys keep fp8 scales per
(block, head, channel), so their bytes per token are per-block overhead amortised over the
block and depend on the block size (16 in the engine).

Capacity follows the engine's allocator: a session holds whole blocks, ``ceil(context / 16)``
of them, and a pool holds ``pool_bytes // bytes_per_block`` blocks (``num_blocks_for``), so
concurrency is ``pool_blocks // blocks_per_session``. The exact-token figure is reported
beside the block-rounded one.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import ModelError

if TYPE_CHECKING:
    from runtime.kv.cache import KVLayout

BLOCK_SIZE = 16  # the engine's default (EngineConfig.block_size)
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what ``auto`` KV storage means
DEFAULT_DTYPE = "float32"  # the engine's ``auto`` model dtype on CPU (bfloat16 on CUDA)

_CONTEXT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmM]?)\s*$")
_CONTEXT_UNITS = {"": 1, "k": 1024, "m": 1024**2}  # "8k" context is 8,192 tokens, "128k" 131,072


def parse_context(text: str | int) -> int:
    """A context length in tokens: ``8192``, ``8k`` (8,192) or ``1.5k`` (1,536); at least 1."""
    if isinstance(text, int):
        tokens = text
    else:
        match = _CONTEXT_RE.match(text)
        if not match:
            raise ValueError(f"not a context length: {text!r} (expected e.g. 8192 or 8k)")
        number, unit = match.groups()
        value = float(number) * _CONTEXT_UNITS[unit.lower()]
        if value != int(value):
            raise ValueError(f"context {text!r} is not a whole number of tokens")
        tokens = int(value)
    if tokens < 1:
        raise ValueError(f"context must be at least 1 token, got {text!r}")
    return tokens


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What KV size depends on: layers, heads, head dim; read from a model or given directly."""

    name: str  # what the user named, or "" for a shape given directly
    architecture: str  # "llama", "qwen2", ...; "" when unknown
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int | None = None  # the model's own context length, when it states one

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"attention heads ({self.num_attention_heads}) must be a multiple of "
                f"KV heads ({self.num_kv_heads})"
            )


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """How to store KV and what to size: the planner's options, checked where they are given."""

    dtype: str = DEFAULT_DTYPE  # the model dtype: what ``auto`` storage keeps
    k_dtype: str = "auto"
    v_dtype: str = "auto"
    block_size: int = BLOCK_SIZE
    context: int | None = None  # tokens per session; None: the model's own context length
    pool_bytes: int | None = None  # size a pool: how many sessions fit
    num_sessions: int | None = None  # size sessions: how large a pool they need

    def __post_init__(self) -> None:
        from runtime.kv.quant import KV_DTYPES

        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        for option in ("k_dtype", "v_dtype"):
            if getattr(self, option) not in KV_DTYPES:
                raise ValueError(
                    f"{option} must be one of {', '.join(KV_DTYPES)}, got {getattr(self, option)!r}"
                )
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.context is not None and self.context < 1:
            raise ValueError(f"context must be at least 1 token, got {self.context}")
        if self.pool_bytes is not None and self.pool_bytes < 1:
            raise ValueError(f"pool size must be positive, got {self.pool_bytes} bytes")
        if self.num_sessions is not None and self.num_sessions < 1:
            raise ValueError(f"sessions must be at least 1, got {self.num_sessions}")


@dataclass(frozen=True, slots=True)
class StorageTerm:
    """One of K or V, per KV head and block: its codes and its scales, in bytes."""

    dtype: str  # the stored dtype: the model's ("float32") or a quantized one ("int8")
    data_bytes_per_head_block: int  # head_dim values per token, block_size tokens
    scale_bytes_per_head_block: int  # 0 for the model dtype
    scales_per_block: bool  # scales shared by a block's tokens: per-token bytes depend on block size


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Every figure the planner reports; bytes are exact integers, as the engine counts them."""

    shape: ModelShape
    dtype: str
    block_size: int
    key: StorageTerm
    value: StorageTerm
    bytes_per_token: int  # KVLayout.bytes_per_token: per-block scales amortised over the block
    bytes_per_block: int
    mha_bytes_per_token: int  # the same storage with one KV head per attention head
    staging_bytes_per_block: int  # full-precision copy of an open block (quantized storage only)
    context: int | None
    context_is_model_max: bool  # the context was not given: the model's own length is used
    session_bytes: int | None  # context * bytes_per_token
    blocks_per_session: int | None  # ceil(context / block_size)
    session_allocated_bytes: int | None  # blocks_per_session * bytes_per_block
    pool_bytes: int | None
    pool_blocks: int | None
    max_sessions: int | None  # pool_blocks // blocks_per_session
    num_sessions: int | None
    pool_bytes_needed: int | None  # num_sessions * session_allocated_bytes

    @property
    def gqa_saving(self) -> float:
        """How many times less KV grouped-query attention stores than full multi-head attention."""
        return self.mha_bytes_per_token / self.bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gqa_saving": self.gqa_saving}


def plan_kv(shape: ModelShape, request: PlanRequest) -> KVPlan:
    """Size ``shape``'s KV cache as ``request`` asks, with the engine's own layout arithmetic."""
    from runtime.kv.cache import num_blocks_for

    layout = _layout(shape.num_kv_heads, shape, request)
    mha = _layout(shape.num_attention_heads, shape, request)
    context = request.context if request.context is not None else shape.max_context
    if context is None and (request.pool_bytes is not None or request.num_sessions is not None):
        raise ValueError("sizing a pool or sessions needs a context length (--context)")
    blocks = None if context is None else math.ceil(context / request.block_size)
    allocated = None if blocks is None else blocks * layout.bytes_per_block
    pool_blocks = None
    if request.pool_bytes is not None:
        pool_blocks = num_blocks_for(request.pool_bytes, layout.bytes_per_token, request.block_size)
    return KVPlan(
        shape=shape,
        dtype=request.dtype,
        block_size=request.block_size,
        key=_term(request.k_dtype, is_key=True, shape=shape, request=request),
        value=_term(request.v_dtype, is_key=False, shape=shape, request=request),
        bytes_per_token=layout.bytes_per_token,
        bytes_per_block=layout.bytes_per_block,
        mha_bytes_per_token=mha.bytes_per_token,
        staging_bytes_per_block=layout.staging_bytes_per_block,
        context=context,
        context_is_model_max=request.context is None and context is not None,
        session_bytes=None if context is None else context * layout.bytes_per_token,
        blocks_per_session=blocks,
        session_allocated_bytes=allocated,
        pool_bytes=request.pool_bytes,
        pool_blocks=pool_blocks,
        max_sessions=None if pool_blocks is None or blocks is None else pool_blocks // blocks,
        num_sessions=request.num_sessions,
        pool_bytes_needed=(
            None if request.num_sessions is None or allocated is None else request.num_sessions * allocated
        ),
    )


def _layout(num_kv_heads: int, shape: ModelShape, request: PlanRequest) -> KVLayout:
    import torch

    from runtime.kv.cache import KVLayout

    return KVLayout(  # the engine's own byte counts, scales included
        num_layers=shape.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=shape.head_dim,
        dtype=getattr(torch, request.dtype),
        block_size=request.block_size,
        k_dtype=request.k_dtype,
        v_dtype=request.v_dtype,
    )


def _term(kv_dtype: str, *, is_key: bool, shape: ModelShape, request: PlanRequest) -> StorageTerm:
    import torch

    from runtime.kv.quant import codec_for

    bs, dim = request.block_size, shape.head_dim
    codec = codec_for(kv_dtype, is_key=is_key)
    if codec is None:
        itemsize = getattr(torch, request.dtype).itemsize
        return StorageTerm(request.dtype, bs * dim * itemsize, 0, scales_per_block=False)
    data, *scales = codec.parts(bs, dim)  # every codec stores its codes first, then its scales
    scale_bytes = sum(spec.nbytes for spec in scales)
    # Per-token scales double with the block; per-block ones do not.
    doubled = sum(spec.nbytes for spec in codec.parts(2 * bs, dim)[1:])
    return StorageTerm(kv_dtype, data.nbytes, scale_bytes, scales_per_block=doubled != 2 * scale_bytes)


# --- reading a model's shape ------------------------------------------------------------------


def read_shape(model: str | Path) -> ModelShape:
    """The shape of a registry model (already pulled), a model directory or a ``.gguf`` file.

    Reads configuration only: never weights, never the network. Raises ``ModelError``.
    """
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return shape_from_gguf(path)
    from runtime.models.loader import resolve_model

    directory = resolve_model(model, pull=False)  # a .gguf was handled above: nothing converts
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"could not read {directory / 'config.json'}: {first}") from exc
    return shape_from_config(config, name=str(model))


def shape_from_config(config: Any, name: str = "") -> ModelShape:
    """A transformers config's shape, read as the engine reads it (``Engine.__init__``)."""
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        raise ModelError(f"{name or 'model'}: sliding-window attention layers are not supported yet")
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if not layers or not heads or not (head_dim or hidden):
        raise ModelError(
            f"{name or 'model'}: config lacks num_hidden_layers, num_attention_heads or "
            "head_dim/hidden_size, so its KV shape is unknown"
        )
    return _shape(
        name,
        architecture=getattr(config, "model_type", "") or "",
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim or hidden // heads,
        max_context=getattr(config, "max_position_embeddings", None),
    )


def shape_from_gguf(path: Path) -> ModelShape:
    """A ``.gguf`` file's shape from its ``{arch}.*`` metadata keys; tensors stay on disk."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a readable GGUF file ({exc})") from exc

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    if not arch:
        raise ModelError(f"{path}: GGUF metadata lacks general.architecture")
    layers = value(f"{arch}.block_count")
    heads = value(f"{arch}.attention.head_count")
    kv_heads = value(f"{arch}.attention.head_count_kv")
    embedding = value(f"{arch}.embedding_length")
    key_length = value(f"{arch}.attention.key_length")
    value_length = value(f"{arch}.attention.value_length")
    heads = _one_count(path, "head_count", heads)
    kv_heads = _one_count(path, "head_count_kv", kv_heads)
    if not layers or not heads or not (key_length or embedding):
        raise ModelError(
            f"{path}: GGUF metadata lacks {arch}.block_count, {arch}.attention.head_count or "
            f"{arch}.embedding_length, so its KV shape is unknown"
        )
    if key_length and value_length and key_length != value_length:
        raise ModelError(f"{path}: keys ({key_length}) and values ({value_length}) differ in length")
    return _shape(
        str(path),
        architecture=arch,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads or heads,
        head_dim=key_length or embedding // heads,
        max_context=value(f"{arch}.context_length"),
    )


def _one_count(path: Path, key: str, count: Any) -> int | None:
    """A head count, which GGUF may store per layer; the engine needs one for every layer."""
    if isinstance(count, list):
        distinct = set(count)
        if len(distinct) != 1:
            raise ModelError(f"{path}: {key} differs between layers ({sorted(distinct)}); not supported")
        count = distinct.pop()
    return None if count is None else int(count)


def _shape(
    name: str,
    *,
    architecture: str,
    num_layers: Any,
    num_attention_heads: Any,
    num_kv_heads: Any,
    head_dim: Any,
    max_context: Any,
) -> ModelShape:
    """A ModelShape from a model's own numbers, whose nonsense is the model's error, not the user's."""
    try:
        return ModelShape(
            name,
            architecture,
            int(num_layers),
            int(num_attention_heads),
            int(num_kv_heads),
            int(head_dim),
            None if max_context is None else int(max_context),
        )
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{name}: {exc}") from exc
