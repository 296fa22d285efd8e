"""How keys and values are stored below the model dtype: the quantize / dequantize math.

Pure functions on tensors, plus a :class:`Codec` per (storage dtype, K or V) naming the tensors a
block needs, so the KV pool allocates and counts bytes from one description. Everything works on
whole blocks, ``(..., block_size, head_dim)``, because a block is quantized once, when it is full.

The layouts follow what worked in practice (KIVI; llama.cpp's users keeping keys at 8 bits).
Keys have outlier *channels* (a few of the 64 dimensions run 10-20x larger, with a steady
sign), so a token's 64 values span a wide range while a channel's 16 values in a block span a
narrow one: integer keys are grouped per (block, head, channel), values per (token, head).
Per-channel scales are float8 e4m3 (1 byte), rounded so the range always covers the group:

- ``int8`` keys: symmetric per (block, head, channel), e4m3 scale. 64 + 64/16 = 68 bytes per
  token and head at block size 16. Per-token int8 keys (66 bytes) measured ~3x the logits KL
  on SmolLM2 and missed the 0.99 top-1 target.
- ``int8`` values: symmetric, one fp16 scale per (token, head). 64 + 2 = 66 bytes.
- ``fp8`` keys and values: e4m3 with one fp16 scale per (token, head), so e4m3's +-448 range is
  used whatever the magnitude. 66 bytes. A float format's error is relative per element, so
  channel grouping buys it little.
- ``int4`` keys: asymmetric per (block, head, channel), e4m3 minimum (rounded down) and step
  (rounded up): 32 + 2 * 64 / 16 = 40 bytes. fp16 metadata would cost 48 and break the 0.30
  target; on SmolLM2, e4m3 metadata costs ~0.6 % perplexity over fp16.
- ``int4`` values: asymmetric per (token, head), fp16 step and minimum. 32 + 4 = 36 bytes.

Keys must stay within e4m3's reach for per-channel metadata: |k| < 448 (SmolLM2 peaks at 24),
and steps below 2^-9 round up to it (a coarser step only on near-constant channels).

Per-token scales are fp16: fp32 would add 2 bytes per token and head and push int8 past 0.53
of bf16 (138/256). Four-bit codes are packed two per byte across a block's tokens (token t with token
t + bs/2, so unpacking writes two contiguous half-blocks); int4 needs a block of >= 2 tokens.

Dequantization writes into a caller's buffer (``out``) with in-place ops: a decode step rebuilds
its context every layer, and on CPU the page faults of fresh multi-megabyte temporaries cost
more than the arithmetic.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

KV_DTYPES = ("auto", "int8", "fp8", "int4")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
_FP8_MAX_BITS = 0x7E  # its magnitude bits: 0x7F is NaN

Parts = tuple[torch.Tensor, ...]  # the stored tensors of one or more blocks, codec-specific


class Scratch:
    """Named buffers reused from call to call, grown when a larger one is asked for."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            # A normal tensor (not an inference one), usable in and out of inference mode;
            # 25 % headroom so a context growing token by token does not reallocate each step.
            with torch.inference_mode(False):
                buf = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


# --- element helpers -------------------------------------------------------------------------


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x, and 0 where x is 0 (an all-zero group quantizes to zeros instead of NaN)."""
    return torch.where(x > 0, x.reciprocal(), torch.zeros_like(x))


def fp8_round_down(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as e4m3, rounded toward -inf, saturating at -448 (never NaN)."""
    nearest = x.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    bits = nearest.view(torch.uint8).to(torch.int16)  # sign-magnitude
    above = nearest.float() > x
    negative = bits >= 0x80
    # One representable step toward -inf: a positive magnitude shrinks, a negative one grows;
    # +0 and -0 step to the smallest negative subnormal (0x81).
    down = torch.where(negative, (bits + 1).clamp(max=0x80 | _FP8_MAX_BITS), bits - 1)
    down = torch.where((bits & 0x7F) == 0, torch.full_like(bits, 0x81), down)
    return torch.where(above, down, bits).to(torch.uint8).view(FP8)


def fp8_round_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as e4m3, rounded toward +inf, saturating at 448."""
    return (-fp8_round_down(-x).float()).to(FP8)


def fp8_to_half_into(codes: torch.Tensor, bits: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """e4m3 codes -> fp16 holding value / 256, exactly, built in the int16 buffers ``bits``, ``sign``.

    torch's own float8 -> float cast runs ~6x slower on CPU. e4m3 (bias 7) and fp16 (bias 15)
    share the layout sign | exponent | mantissa, so moving the 7 magnitude bits up by 7 gives
    the fp16 of value * 2^-8 (subnormals included), and the sign moves to bit 15.
    """
    bits.copy_(codes.view(torch.uint8))
    torch.bitwise_and(bits, 0x80, out=sign).mul_(256)  # bit 7 -> bit 15
    return bits.bitwise_and_(0x7F).mul_(128).bitwise_or_(sign).view(torch.float16)


def fp8_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 codes as ``dtype``, exactly (for small tensors: allocates its temporaries)."""
    bits = torch.empty(codes.shape, dtype=torch.int16, device=codes.device)
    half = fp8_to_half_into(codes, bits, torch.empty_like(bits))
    return half.to(dtype).mul_(256)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(..., bs, D) uint8 codes in [0, 15] -> (..., bs/2, D) bytes.

    Token t of a block shares a byte with token t + bs/2 (low and high nibble): unpacking then
    writes two contiguous half-blocks, ~3x faster on CPU than interleaving neighbours.
    """
    half = codes.shape[-2] // 2
    return codes[..., :half, :] | (codes[..., half:, :] << 4)


def unpack_int4(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(..., bs/2, D) bytes -> (..., bs, D) uint8 codes, into ``out`` when given."""
    half = packed.shape[-2]
    if out is None:
        out = torch.empty(
            (*packed.shape[:-2], 2 * half, packed.shape[-1]), dtype=torch.uint8, device=packed.device
        )
    torch.bitwise_and(packed, 0x0F, out=out[..., :half, :])
    torch.bitwise_right_shift(packed, 4, out=out[..., half:, :])
    return out


def _unpack_int4_into(packed: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """The codes of ``packed`` as floats in ``out`` (..., bs, D), via a reused uint8 buffer."""
    codes = scratch.get("int4_codes", tuple(out.shape), torch.uint8, out.device)
    return out.copy_(unpack_int4(packed, codes))


# --- per-token formats: groups are (token, head) over the head dimension ---------------------


def quantize_int8(x: torch.Tensor) -> Parts:
    """x (..., D) -> codes (..., D) int8, scale (...) fp16; |x - x^| <= scale / 2 (any leading dims)."""
    x = x.float()
    scale = (x.abs().amax(-1) / 127).to(torch.float16)  # (...)
    inv = _safe_reciprocal(scale.float())[..., None]  # (..., 1): quantize with the stored scale
    codes = (x * inv).round_().clamp_(-127, 127).to(torch.int8)  # (..., D)
    return codes, scale


def dequantize_int8(parts: Parts, out: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    codes, scale = parts
    return out.copy_(codes).mul_(scale.to(out.dtype)[..., None])  # out (..., D)


def quantize_fp8(x: torch.Tensor) -> Parts:
    """x (..., D) -> e4m3 (..., D), scale (...) fp16; relative error <= 2^-4 per element."""
    x = x.float()
    scale = (x.abs().amax(-1) / FP8_MAX).to(torch.float16)  # (...)
    inv = _safe_reciprocal(scale.float())[..., None]
    return (x * inv).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(parts: Parts, out: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    codes, scale = parts
    bits = scratch.get("fp8_bits", tuple(codes.shape), torch.int16, codes.device)
    sign = scratch.get("fp8_sign", tuple(codes.shape), torch.int16, codes.device)
    out.copy_(fp8_to_half_into(codes, bits, sign))  # value / 256
    return out.mul_(scale.to(out.dtype)[..., None] * 256)


def quantize_int4_per_token(x: torch.Tensor) -> Parts:
    """x (..., bs, D) -> packed (..., bs/2, D) uint8, step (..., bs) fp16, minimum (..., bs) fp16."""
    x = x.float()
    low = x.amin(-1).to(torch.float16)  # (...)
    step = ((x.amax(-1) - low.float()) / 15).to(torch.float16)  # (...)
    inv = _safe_reciprocal(step.float())[..., None]
    codes = ((x - low.float()[..., None]) * inv).round_().clamp_(0, 15).to(torch.uint8)  # (..., bs, D)
    return pack_int4(codes), step, low


def dequantize_int4_per_token(parts: Parts, out: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    packed, step, low = parts
    _unpack_int4_into(packed, out, scratch)  # (..., bs, D) codes
    # mul_ + add_: addcmul with a scale broadcast along the last dim runs 4x slower on CPU.
    return out.mul_(step.to(out.dtype)[..., None]).add_(low.to(out.dtype)[..., None])


# --- per-channel keys: groups are (block, head, channel) over the block's tokens --------------


def quantize_int8_per_channel(x: torch.Tensor) -> Parts:
    """x (..., bs, D) -> codes (..., bs, D) int8, scale (..., D) e4m3 (rounded up); |x - x^| <= scale / 2."""
    x = x.float()
    scale = fp8_round_up(x.abs().amax(-2) / 127)  # (..., D): 127 * scale covers the channel
    inv = _safe_reciprocal(scale.float())[..., None, :]  # (..., 1, D)
    codes = (x * inv).round_().clamp_(-127, 127).to(torch.int8)  # (..., bs, D)
    return codes, scale


def dequantize_int8_per_channel(parts: Parts, out: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    codes, scale = parts
    return out.copy_(codes).mul_(fp8_to_float(scale, out.dtype)[..., None, :])  # out (..., bs, D)


def quantize_int4_per_channel(x: torch.Tensor) -> Parts:
    """x (..., bs, D) -> packed (..., bs/2, D) uint8, step (..., D) e4m3, minimum (..., D) e4m3."""
    x = x.float()
    low = fp8_round_down(x.amin(-2))  # (..., D), <= every value of its channel
    low_f = low.float()
    step = fp8_round_up((x.amax(-2) - low_f) / 15)  # (..., D), so low + 15 * step covers the max
    inv = _safe_reciprocal(step.float())[..., None, :]  # (..., 1, D)
    codes = ((x - low_f[..., None, :]) * inv).round_().clamp_(0, 15).to(torch.uint8)  # (..., bs, D)
    return pack_int4(codes), step, low


def dequantize_int4_per_channel(parts: Parts, out: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    packed, step, low = parts
    _unpack_int4_into(packed, out, scratch)  # (..., bs, D) codes
    step_f = fp8_to_float(step, out.dtype)[..., None, :]  # (..., 1, D)
    low_f = fp8_to_float(low, out.dtype)[..., None, :]
    return torch.addcmul(low_f, out, step_f, out=out)


# --- codecs ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartSpec:
    """One stored tensor of a block, per KV head: its shape after (head, block) and its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for dim in self.shape:
            n *= dim
        return n


Dequantize = Callable[[Parts, torch.Tensor, Scratch], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Codec:
    """A storage format for keys or values: what a block stores, and how to get there and back."""

    name: str
    parts: Callable[[int, int], tuple[PartSpec, ...]]  # (block_size, head_dim) -> specs
    quantize: Callable[[torch.Tensor], Parts]  # (..., bs, D) float -> parts shaped (..., *spec.shape)
    dequantize_into: Dequantize  # parts, out (..., bs, D), scratch -> out

    def bytes_per_block(self, block_size: int, head_dim: int) -> int:
        """Exact bytes one block of one KV head occupies, scales included."""
        return sum(spec.nbytes for spec in self.parts(block_size, head_dim))

    def dequantize(self, parts: Parts, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Allocating convenience for tests and tools: (..., bs, D) in ``dtype``."""
        packed = self.name == "int4"  # two tokens per byte
        shape = (*parts[0].shape[:-2], parts[0].shape[-2] * (2 if packed else 1), parts[0].shape[-1])
        out = torch.empty(shape, dtype=dtype, device=parts[0].device)
        return self.dequantize_into(parts, out, Scratch())


def _per_token_parts(
    data: torch.dtype, packed: bool, metas: int
) -> Callable[[int, int], tuple[PartSpec, ...]]:
    def parts(bs: int, d: int) -> tuple[PartSpec, ...]:
        data_spec = PartSpec((bs // 2, d) if packed else (bs, d), data)
        return (data_spec,) + tuple(PartSpec((bs,), torch.float16) for _ in range(metas))

    return parts


def _per_channel_int8_parts(bs: int, d: int) -> tuple[PartSpec, ...]:
    return PartSpec((bs, d), torch.int8), PartSpec((d,), FP8)


def _per_channel_int4_parts(bs: int, d: int) -> tuple[PartSpec, ...]:
    return PartSpec((bs // 2, d), torch.uint8), PartSpec((d,), FP8), PartSpec((d,), FP8)


INT8 = Codec("int8", _per_token_parts(torch.int8, False, 1), quantize_int8, dequantize_int8)
INT8_PER_CHANNEL = Codec(
    "int8", _per_channel_int8_parts, quantize_int8_per_channel, dequantize_int8_per_channel
)
FP8_E4M3 = Codec("fp8", _per_token_parts(FP8, False, 1), quantize_fp8, dequantize_fp8)
INT4_PER_TOKEN = Codec(
    "int4", _per_token_parts(torch.uint8, True, 2), quantize_int4_per_token, dequantize_int4_per_token
)
INT4_PER_CHANNEL = Codec(
    "int4", _per_channel_int4_parts, quantize_int4_per_channel, dequantize_int4_per_channel
)


def codec_for(kv_dtype: str, is_key: bool) -> Codec | None:
    """The codec for a storage dtype name; None for ``auto`` (the model dtype, stored as is)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return None
    if kv_dtype == "int4":
        return INT4_PER_CHANNEL if is_key else INT4_PER_TOKEN
    if kv_dtype == "int8":
        return INT8_PER_CHANNEL if is_key else INT8
    return FP8_E4M3  # a float format: its error is relative per element, so per token suffices
