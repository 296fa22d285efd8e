"""The stated round-trip error bounds of each KV codec, checked on block-shaped tensors.

Shared by the unit tests (random tensors) and the default-model tests (real keys and values).
Each check quantizes ``x`` (..., bs, D), dequantizes, and asserts the bound element by element;
it returns the relative error ||x - x^|| / ||x|| for callers that also bound that.
"""

import torch

from runtime.kv import quant as kq

FP16_EPS = 2.0**-10  # one fp16 ulp at 1.0, relative


def check_int8(x: torch.Tensor) -> float:
    """|x - x^| <= scale / 2 with scale ~ absmax / 127 per (token, head)."""
    codes, scale = kq.quantize_int8(x)
    y = kq.INT8.dequantize((codes, scale))
    step = scale.float()[..., None]
    absmax = x.abs().amax(-1, keepdim=True)
    assert torch.all((x - y).abs() <= step / 2 * (1 + FP16_EPS) + 1e-7)
    assert torch.all(step <= absmax / 127 * (1 + FP16_EPS) + 1e-7)
    return float((x - y).norm() / x.norm())


def check_int8_per_channel(x: torch.Tensor) -> float:
    """Per (block, head, channel): 127 * scale >= the channel's absmax, so |x - x^| <= scale / 2;
    the e4m3 scale (rounded up) is at most 12.5 % above absmax / 127, or its 2^-9 floor."""
    codes, scale8 = kq.quantize_int8_per_channel(x)
    y = kq.INT8_PER_CHANNEL.dequantize((codes, scale8))
    scale = scale8.float()[..., None, :]  # (..., 1, D)
    absmax = x.abs().amax(-2, keepdim=True)
    assert torch.all(127 * scale >= absmax) and torch.all(scale <= absmax / 127 * 1.125 + 2.0**-9)
    assert torch.all((x - y).abs() <= scale / 2 * (1 + 1e-5) + 1e-6)
    return float((x - y).norm() / x.norm())


def check_fp8(x: torch.Tensor) -> float:
    """|x - x^| <= 2^-4 |x| (3 mantissa bits) + 2^-10 scale (e4m3's subnormal spacing / 2)."""
    parts = kq.quantize_fp8(x)
    y = kq.FP8_E4M3.dequantize(parts)
    scale = parts[1].float()[..., None]
    assert torch.all((x - y).abs() <= 2.0**-4 * x.abs() * (1 + FP16_EPS) + 2.0**-10 * scale + 1e-7)
    return float((x - y).norm() / x.norm())


def check_int4_per_token(x: torch.Tensor) -> float:
    """|x - x^| <= step / 2 + fp16 rounding of the minimum; step ~ (max - min) / 15 per (token, head)."""
    parts = kq.quantize_int4_per_token(x)
    y = kq.INT4_PER_TOKEN.dequantize(parts)
    step = parts[1].float()[..., None]
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    magnitude = torch.maximum(lo.abs(), hi.abs())
    assert torch.all(step <= (hi - lo) / 15 * (1 + FP16_EPS) + FP16_EPS * magnitude / 15 + 1e-7)
    assert torch.all((x - y).abs() <= step / 2 + FP16_EPS * magnitude + 1e-6)
    return float((x - y).norm() / x.norm())


def check_int4_per_channel(x: torch.Tensor) -> float:
    """Per (block, head, channel): low <= min, low + 15 step >= max, so |x - x^| <= step / 2; the
    e4m3 rounding of low (down) and step (up) widens the range by at most |min| / 8 and 12.5 %."""
    packed, step8, low8 = kq.quantize_int4_per_channel(x)
    y = kq.INT4_PER_CHANNEL.dequantize((packed, step8, low8))
    step, low = step8.float()[..., None, :], low8.float()[..., None, :]  # (..., 1, D)
    lo, hi = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True)
    assert torch.all(low <= lo) and torch.all(low + 15 * step >= hi * (1 - 1e-6) - 1e-6)
    widest = (hi - lo + lo.abs() / 8 + 2.0**-9) / 15 * 1.125 + 2.0**-9
    assert torch.all(step <= widest)
    assert torch.all((x - y).abs() <= step / 2 * (1 + 1e-5) + 1e-6)
    return float((x - y).norm() / x.norm())


CHECKS = {
    "int8-keys": check_int8_per_channel,
    "int8": check_int8,
    "fp8": check_fp8,
    "int4-values": check_int4_per_token,
    "int4-keys": check_int4_per_channel,
}
