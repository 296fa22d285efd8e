"""Steps of many rows (prefill) multiply quantized weights through bfloat16 copies.

The int4 and int8 kernels (``runtime/layers/weights.py``) make a one-row decode step cheap because
they read a quarter or half of the bytes, but they unpack the codes again for every few rows
(ATen's CPU int4 kernel streams the weights once per 4 rows), so their cost grows with the rows
while a bfloat16 product on the matrix units barely does. Measured on a 2-core AMD EPYC (Zen 4,
AVX-512 bf16, torch 2.13), the default model's 120 layer matrices, ms per step:

==========  ============  ===========================  ============================
rows        int4 kernel   bfloat16 ``F.linear``         bfloat16, prepacked (oneDNN)
==========  ============  ===========================  ============================
1           4.0           17.4                         11.0
8           11.2          19.3                         11.8
16          21.7          24.8                         16.2
64          95.2          58.9                         48.3
200         330.3         151.0                        137.5
==========  ============  ===========================  ============================

So a quantized model keeps, beside its packed weights, a bfloat16 copy of each layer matrix in
oneDNN's blocked layout (eager ``F.linear`` on a plain bfloat16 weight re-lays it out on every
call), and a step of at least :attr:`WideCopies.min_rows` rows multiplies by the copies. The
copies are the weights the kernels multiply by — the same codes, scales and zeros, dequantized —
so only the products' rounding differs. Decode steps and the compiled graphs keep the kernels,
and so does scoring a format's quality (``Engine.prompt_logits``), so its KLD is the kernels'.

Where the copies start to pay differs between CPUs (an Intel with AMX runs bfloat16 far faster
than this EPYC), so it is timed once per machine on the model's own matrices, both ways, at each
of :data:`CANDIDATE_ROWS`, and kept beside the GEMM plans: the threshold is the fewest rows from
which the copies are faster at that count and every larger one, or none at all (then no copies
are built). The copies cost 2 bytes per weight (212 MB for the default model beside its 55 MB of
int4 matrices), so they are built only when that fits :data:`MAX_MEMORY_SHARE` of the memory the
system reports available. Building them costs about 0.7 s at every load of the default model
(dequantizing and re-laying out 120 matrices); the timing, once per machine, about two more.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.layers.gemm import MIN_TUNED_ELEMENTS, Shape, best_time, keep_timing, kept_timing, timing_path
from runtime.layers.weights import ACTIVATION_DTYPE, Int4Weight, Int8Weight, QuantizedWeight
from runtime.sizes import available_memory_bytes

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (4, 8, 16, 32, 64)
# A share of MemAvailable the copies may take; beyond it the kernels serve every step.
MAX_MEMORY_SHARE = 0.25
# oneDNN picks its blocked layout for a batch size; prefill chunks are hundreds of rows.
PREPACK_ROWS_HINT = 256
TIMING_KIND = "wide-steps"


class WideMatrix:
    """One layer matrix as bfloat16, prepacked for oneDNN where torch has it: ``x @ w.T``."""

    def __init__(self, dense: torch.Tensor) -> None:
        self.shape: Shape = (dense.shape[0], dense.shape[1])
        self.nbytes = dense.numel() * dense.element_size()
        self.prepacked = _prepack_available(dense)
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(dense, PREPACK_ROWS_HINT) if self.prepacked else dense
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for x (M, K): (M, N) bfloat16."""
        x = x.to(ACTIVATION_DTYPE)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


def _prepack_available(dense: torch.Tensor) -> bool:
    return (
        dense.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def dense_copy(weight: QuantizedWeight, source: torch.Tensor) -> torch.Tensor:
    """The bfloat16 (N, K) matrix ``weight``'s kernel multiplies by.

    ``source`` is the float weight ``weight`` was quantized from: int4 packing is the kernel's
    opaque layout, so the codes are found again from it with the quantizer's own rule against the
    stored scales and zeros (the same numbers, so the same codes) rather than read back through the
    kernel, which costs ten times as long.
    """
    if isinstance(weight, Int8Weight):
        return (weight.qweight.float() * weight.scales.float()[:, None]).to(ACTIVATION_DTYPE)
    assert isinstance(weight, Int4Weight)
    n, k, g = weight.out_features, weight.in_features, weight.group_size
    scales = weight.scales_and_zeros[..., 0].T.float()[..., None]  # (N, G, 1)
    zeros = weight.scales_and_zeros[..., 1].T.float()[..., None]
    base = zeros - 8 * scales  # the grid's code-0 value, as weights.int4_codes computes it
    w = source.detach().float().view(n, k // g, g)
    codes = torch.round((w - base) / scales).clamp(0, 15)
    return ((codes - 8) * scales + zeros).view(n, k).to(ACTIVATION_DTYPE)


@dataclass(slots=True)
class WideCopies:
    """Bfloat16 copies of a model's quantized layer matrices, for steps of ``min_rows`` or more."""

    matrices: list[WideMatrix]  # in the order of the quantized matrices they copy
    min_rows: int

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.matrices)


def build_wide_copies(
    quantized: Sequence[QuantizedWeight], sources: Sequence[torch.Tensor], enabled: bool = True
) -> WideCopies | None:
    """Copies of ``quantized`` (from their float ``sources``), or None where they would not pay.

    None with ``enabled`` false, off the CPU, for matrices too small to matter, when the copies do
    not fit the memory share, or when the timing (cached per machine) finds no row count from which
    they are faster.
    """
    if not enabled or not quantized or any(s.device.type != "cpu" for s in sources):
        return None
    if max(w.shape[0] * w.shape[1] for w in quantized) < MIN_TUNED_ELEMENTS:
        return None
    copy_bytes = sum(2 * w.shape[0] * w.shape[1] for w in quantized)
    available = available_memory_bytes()
    if available is not None and copy_bytes > MAX_MEMORY_SHARE * available:
        log.info("no copies for wide steps: %d MB, %d MB available", copy_bytes >> 20, available >> 20)
        return None
    shapes = sorted({w.shape for w in quantized})
    path = timing_path(TIMING_KIND, shapes, ACTIVATION_DTYPE)
    min_rows = _read_min_rows(path)
    if min_rows == 0:  # timed before on this machine: the kernels win at every candidate
        return None
    matrices = [WideMatrix(dense_copy(w, s)) for w, s in zip(quantized, sources, strict=True)]
    if min_rows is None:
        min_rows = time_min_rows(quantized, matrices)
        keep_timing(path, {"min_rows": min_rows or 0})
        log.info("wide steps from %s rows", min_rows)
    if not min_rows:
        return None
    return WideCopies(matrices, min_rows)


def _read_min_rows(path: Path) -> int | None:
    """The kept threshold (0: never), or None where none was kept or it cannot be read."""
    kept = kept_timing(path)
    value = kept.get("min_rows") if isinstance(kept, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None
    return value


def time_min_rows(quantized: Sequence[QuantizedWeight], copies: Sequence[WideMatrix]) -> int | None:
    """The fewest of :data:`CANDIDATE_ROWS` from which the copies beat the kernels at every count.

    Every matrix is multiplied in turn, as in a real forward, so weights stream from memory.
    """
    generator = torch.Generator().manual_seed(0)
    faster = []
    for rows in CANDIDATE_ROWS:
        inputs = {
            k: torch.randn(rows, k, generator=generator).to(ACTIVATION_DTYPE)
            for k in {w.shape[1] for w in quantized}
        }
        kernels = best_time(partial(_multiply_all, quantized, inputs))
        dense = best_time(partial(_multiply_all, copies, inputs))
        faster.append(dense < kernels)
    return threshold(CANDIDATE_ROWS, faster)


def threshold(rows: Sequence[int], faster: Sequence[bool]) -> int | None:
    """The fewest of ``rows`` (ascending) from which ``faster`` holds at that count and every larger one.

    A single win below a loss (noise, or a cache effect at one size) does not count: the copies
    then serve only the counts where they won throughout.
    """
    min_rows = None
    for count, wins in reversed(list(zip(rows, faster, strict=True))):
        if not wins:
            break
        min_rows = count
    return min_rows


def _multiply_all(
    matrices: Sequence[QuantizedWeight] | Sequence[WideMatrix], inputs: dict[int, torch.Tensor]
) -> None:
    for m in matrices:
        m.matmul(inputs[m.shape[1]])
