"""The output head of the quantized formats, in two passes: coarse logits, then the top ones exact.

A decode step multiplies its rows by the whole head (SmolLM2's: 49,152 x 576, a fifth of the
model's bytes). Only the few largest logits decide the next token and hold nearly all of the
distribution's mass, so the head runs in two passes: a coarse product over the whole vocabulary
(int8 codes with one scale per output channel) picks :data:`NUM_CANDIDATES` candidates per row,
whose logits are then recomputed in float32 from the float head's own rows (a gather of 64 rows,
not a product over 49,152). The rest of the vocabulary keeps its coarse logits.

Measured on the default model with int4 layers over 256 held tokens against float32 weights
(Intel Xeon, 2026-12-05): an int8 head alone gave KLD 1.7e-3, the bfloat16 head 6.3e-4 (top-1
0.980), the int8 head with its top 16 rescored 6.0e-4 and with its top 64 rescored 4.6e-4
(top-1 0.988): better than the bfloat16 head, whose logits are rounded to bfloat16, at about
half its cost for one row (1.3 ms against 2.2 ms). With more rows the bfloat16 product catches
up on CPUs with bfloat16 matrix units (AMX: 1.9 ms for 8 rows against 3.5 ms for int8), so the
coarse pass is timed both ways on this machine for each row bucket when the head is first built,
and the faster one is kept (beside the GEMM plans, keyed like them, so later loads read it: the
timing costs about 2 s a load on a 2-core machine); the candidates' logits are the same float32
numbers either way.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.layers.gemm import ROW_BUCKETS, best_time, keep_timing, kept_timing, row_bucket, timing_path
from runtime.layers.weights import ACTIVATION_DTYPE, Int8Weight, quantize_int8

NUM_CANDIDATES = 64


@dataclass(slots=True)
class RescoredHead:
    """Logits ``x @ exact.T``: coarse for the whole vocabulary, float32 for each row's top candidates."""

    coarse: Int8Weight  # (V, K) int8 codes and per-channel scales, of ``exact``
    exact: torch.Tensor  # (V, K) bfloat16: the head itself (often the tied embedding)
    num_candidates: int = NUM_CANDIDATES
    # Per ROW_BUCKETS entry: whether the int8 product (True) or the bfloat16 one is the coarse pass.
    int8_rows: tuple[bool, ...] = field(default_factory=lambda: (True,) * len(ROW_BUCKETS))

    @classmethod
    def build(cls, exact: torch.Tensor, time_passes: bool = True) -> "RescoredHead":
        """The head over ``exact`` (bfloat16), its coarse pass timed on this CPU (or int8 throughout)."""
        head = cls(quantize_int8(exact.float()), exact, min(NUM_CANDIDATES, exact.shape[0]))
        if time_passes and exact.device.type == "cpu":
            head.int8_rows = head._timed_int8_rows()
        return head

    @property
    def shape(self) -> tuple[int, int]:
        return (self.exact.shape[0], self.exact.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes one row's logits read: the coarse codes and scales, and its candidates' float rows."""
        return self.coarse.nbytes + self.num_candidates * self.exact.shape[1] * self.exact.element_size()

    def uses_int8(self, rows: int) -> bool:
        """Whether the coarse pass for ``rows`` rows is the int8 product (else the bfloat16 one)."""
        bucket = row_bucket(rows)
        return bucket is not None and self.int8_rows[bucket]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (M, V) float32 for x (M, K): each row's top candidates exact, the rest coarse."""
        coarse, int8 = self.coarse, self.uses_int8(x.shape[0])
        return rescored_logits(x, coarse.qweight, coarse.scales, self.exact, int8, self.num_candidates)

    def dequantize(self) -> torch.Tensor:
        """The coarse pass's weight (V, K) float32 (the candidates' logits use ``exact`` instead)."""
        return self.coarse.dequantize()

    def _timed_int8_rows(self) -> tuple[bool, ...]:
        """Per row bucket, whether the int8 coarse pass is the faster here: read back, or timed and kept."""
        path = timing_path("rescored-head", [self.shape], self.exact.dtype)
        kept = kept_timing(path)
        if isinstance(kept, list) and len(kept) == len(ROW_BUCKETS):
            if all(isinstance(v, bool) for v in kept):
                return tuple(kept)
        int8_rows = tuple(self._int8_is_faster(rows) for rows in ROW_BUCKETS)
        keep_timing(path, list(int8_rows))
        return int8_rows

    def _int8_is_faster(self, rows: int) -> bool:
        x = torch.randn(rows, self.exact.shape[1], generator=torch.Generator().manual_seed(0))
        x = x.to(ACTIVATION_DTYPE)
        int8 = best_time(lambda: self.coarse.matmul(x), repeats=3)
        bfloat16 = best_time(lambda: F.linear(x, self.exact), repeats=3)
        return int8 < bfloat16


def rescored_logits(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    exact: torch.Tensor,
    use_int8: bool,
    num_candidates: int,
) -> torch.Tensor:
    """The two passes over plain tensors, so the compiled decode step traces the same code."""
    if use_int8:
        coarse = torch.ops.aten._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), qweight, scales)
    else:
        coarse = F.linear(x.to(exact.dtype), exact)
    logits = coarse.float()  # (M, V)
    candidates = logits.topk(num_candidates, dim=-1).indices  # (M, C)
    rows = exact[candidates].float()  # (M, C, K)
    scored = torch.bmm(rows, x.float()[:, :, None])[:, :, 0]  # (M, C)
    return logits.scatter(1, candidates, scored)
