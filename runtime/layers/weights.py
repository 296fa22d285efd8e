"""Weight formats for the lean forward: float weights, or int8 / int4 weights with their scales.

A format names how the decoder's matrices (the fused q/k/v, o, fused gate/up, down and the
output head) are stored and multiplied:

- ``float32`` / ``bfloat16``: plain tensors, multiplied in the form the GEMM plan chose.
- ``int8``: one int8 per weight and one scale per output channel (symmetric, max-abs),
  multiplied by ``aten._weight_int8pack_mm``.
- ``int4``: asymmetric, one scale and one minimum per group of :data:`INT4_GROUP_SIZE`
  consecutive inputs, packed for ``aten._weight_int4pack_mm_for_cpu`` (the output head in
  bfloat16, see :data:`HEAD_FORMAT`).

Both integer kernels have their vectorized path only for bfloat16 activations (float32 inputs
fall to a scalar loop), so with a quantized format the products' inputs and outputs, attention
and the ``auto`` KV dtype are bfloat16 (the residual stream stays float32, see the forward).
On a 2-core AMD EPYC one decode step's products cost about 54 ms in float32, 24 ms in int8 and
10 ms in int4 (a machine shared with other work, so noisy).

The int4 format is chosen to hold GGUF Q4_1 models almost exactly: a Q4_1 block is 32 values
``d * q + m`` with q in 0..15, so a group's minimum and maximum are (usually) codes 0 and 15
and min/max quantization of the dequantized weights finds the same grid again, up to the
bfloat16 rounding of the scale and minimum. The codes are chosen against the rounded grid, so
that rounding is the only error the scales add.
"""

from dataclasses import dataclass

import torch

WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
FLOAT_FORMATS = ("float32", "bfloat16")
QUANTIZED_FORMATS = ("int8", "int4")
INT4_GROUP_SIZE = 32
# The CPU int4 kernel packs output channels in tiles of 16; other shapes fall back to int8.
INT4_OUTPUT_MULTIPLE = 16
ACTIVATION_DTYPE = torch.bfloat16  # of the quantized formats: their kernels' fast path
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def check_weight_format(weights: str, dtype: str) -> None:
    """Raise ``ValueError`` when ``weights`` is unknown or cannot go with ``dtype`` (a dtype name)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    dtype = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if dtype == "auto" or weights == "auto":
        return
    if weights in QUANTIZED_FORMATS and dtype != "bfloat16":
        raise ValueError(
            f"{weights} weights run with bfloat16 activations; drop --dtype {dtype} or use bfloat16"
        )
    if weights in FLOAT_FORMATS and dtype != weights:
        raise ValueError(f"--weights {weights} and --dtype {dtype} disagree; give one of them")


def dtype_for(weights: str, dtype: str) -> str:
    """The dtype to load the model in for ``weights`` (already checked against ``dtype``).

    Quantized formats load the stored precision (float32) and quantize from it.
    """
    if weights in FLOAT_FORMATS:
        return weights
    if weights in QUANTIZED_FORMATS:
        return "float32"
    return dtype


@dataclass(slots=True)
class Int8Weight:
    """A weight (N, K) as int8 codes and one scale per output channel: ``w ≈ qweight * scales[:, None]``."""

    qweight: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N,) bfloat16

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x (M, K) bfloat16: (M, N) bfloat16."""
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]  # (N, K)


@dataclass(slots=True)
class Int4Weight:
    """A weight (N, K) as 4-bit codes in groups along K, packed for the CPU kernel.

    Each group stores ``scale`` and ``zero`` with ``w ≈ (q - 8) * scale + zero`` (the kernel's
    convention), i.e. ``zero = minimum + 8 * scale``.
    """

    packed: torch.Tensor  # (N, K / 2) uint8, the kernel's tiled layout
    scales_and_zeros: torch.Tensor  # (K / group_size, N, 2) bfloat16
    group_size: int
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x (M, K) bfloat16: (M, N) bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros
        )

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, (N, K) float32, read back through the kernel itself."""
        eye = torch.eye(self.in_features, dtype=ACTIVATION_DTYPE)
        return self.matmul(eye).float().T.contiguous()


QuantizedWeight = Int8Weight | Int4Weight


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of ``weight`` (N, K), scales rounded to bfloat16 first."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    scales = scales.to(ACTIVATION_DTYPE)
    qweight = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(qweight.contiguous(), scales.contiguous())


def int4_codes(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max int4 of ``weight`` (N, K) in groups of ``group_size`` along K.

    Returns codes (N, K) int32 in 0..15 and each group's bfloat16 scale and zero (N, K / group_size),
    with ``w ≈ (codes - 8) * scale + zero``. Codes are rounded against the bfloat16 grid.
    """
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)  # (N, G, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # (N, G)
    steps = _grid_steps(w, low, high)
    exact_scales = ((high - low) / steps).clamp(min=torch.finfo(torch.float32).tiny)
    scales = exact_scales.to(ACTIVATION_DTYPE)
    # The zero from the exact scale: the scale's rounding then errs in opposite directions either
    # side of code 8 (at most 8 of its roundings) instead of piling up towards code 15.
    zeros = (low + 8 * exact_scales).to(ACTIVATION_DTYPE)
    base = zeros.float() - 8 * scales.float()  # the grid's code-0 value after rounding
    codes = torch.round((w - base[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return codes.to(torch.int32).view(n, k), scales, zeros


def _grid_steps(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per group (N, G): how many grid steps span min..max — the group's own if it lies on one.

    A Q4_1 block whose codes do not reach both 0 and 15 spans fewer than 15 steps of its
    grid; min/max over 15 steps would then put a finer grid through it that misses its values.
    The smallest gap between its sorted values is its step, when every value lies on multiples
    of it; otherwise (weights not from a 4-bit grid) the span is cut into 15 steps.
    """
    span = (high - low).clamp(min=torch.finfo(torch.float32).tiny)
    ordered = w.sort(dim=-1).values
    gaps = ordered.diff(dim=-1)
    gaps = torch.where(gaps > span[..., None] * 1e-3, gaps, torch.full_like(gaps, float("inf")))
    step = gaps.amin(dim=-1)  # (N, G); inf for a constant group
    steps = torch.round(span / step)
    levels = (w - low[..., None]) / step[..., None]
    on_grid = ((levels - levels.round()).abs() < 0.02).all(dim=-1) & (steps >= 1) & (steps <= 15)
    return torch.where(on_grid, steps, torch.full_like(steps, 15.0))


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    n, k = weight.shape
    codes, scales, zeros = int4_codes(weight, group_size)
    # innerKTiles is a layout choice of the CUDA kernel; the CPU packer accepts and ignores it.
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (G, N, 2)
    return Int4Weight(packed, scales_and_zeros, group_size, n, k)


def int4_fits(shape: tuple[int, int], group_size: int = INT4_GROUP_SIZE) -> bool:
    return shape[0] % INT4_OUTPUT_MULTIPLE == 0 and shape[1] % group_size == 0


def quantize(weight: torch.Tensor, weights: str) -> QuantizedWeight:
    """``weight`` (N, K) in the quantized format ``weights``; int4 falls back to int8 where it cannot pack."""
    if weights == "int4" and int4_fits((weight.shape[0], weight.shape[1])):
        return quantize_int4(weight)
    if weights in QUANTIZED_FORMATS:
        return quantize_int8(weight)
    raise ValueError(f"not a quantized weight format: {weights!r}")
