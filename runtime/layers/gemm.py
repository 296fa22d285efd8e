"""Matrix products for the lean forward, asked of BLAS in the form this machine runs fastest.

``y = x @ W.T`` (x: M rows of activations, W: the layer's weight) can be asked of BLAS in forms
that compute the same numbers up to rounding: ``F.linear`` (x times W transposed), or
weight-major (W times x transposed, then transposed back), whole or in chunks of rows. They
are not the same kernel. On an AMD EPYC with torch's MKL, weight-major reads weights 2-3x as
fast for 2 to 4 rows, 8 rows run fastest as two chunks of 4, and one row is fastest padded to
two, since the matrix-vector path streams weights at half the rate of the two-column product
(SmolLM2's 113 MB output projection: 12.4 ms as one row, 5.4 ms padded to two). On an Intel
CPU with AMX, ``F.linear`` was already at 0.8 of the memory bandwidth. So nothing is assumed:
when the engine loads a model on the CPU it times the forms on the model's own weights, shape
by shape, for each power-of-two row count up to :data:`ROW_BUCKETS`'s last (decode-sized
batches; a prefill of more rows is compute-bound and keeps ``F.linear``), and keeps the
fastest. A row count between two buckets takes the larger bucket's form: a form timed fastest
for 16 rows ran 24 or 29 rows (a short prefill over a cached chat) 1.7-1.9x slower than
``F.linear``, which the 32-row timing picks. The choice is cached on disk, keyed by CPU, torch
version, thread count, dtype and shapes, so the timing runs once per machine.

Plans are kept in ``gemm/`` under liubai's cache dir (``runtime/paths.py``), or in the directory
named by ``LIUBAI_GEMM_PLAN_DIR`` when it is set: the tests point it at a temporary directory, so
that no test reads a plan an earlier run left on the machine.
"""

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.paths import cache_dir

log = logging.getLogger(__name__)

PLAN_DIR_ENV = "LIUBAI_GEMM_PLAN_DIR"
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LINEAR = 0  # a plan entry: F.linear; any other entry n: weight-major in chunks of about n rows
# Below this many weight elements a product costs microseconds whichever form it takes.
MIN_TUNED_ELEMENTS = 1 << 17
# A weight-major form is chosen only when it is clearly faster: a close call would flip between runs.
MIN_GAIN = 0.9
Shape = tuple[int, int]


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int = LINEAR
) -> torch.Tensor:
    """``x @ weight.T + bias`` for x (M, K), weight (N, K): (M, N), contiguous, in the form ``chunk``."""
    if chunk == LINEAR:
        return F.linear(x, weight, bias)
    if x.shape[0] == 1:
        y = torch.mm(weight, F.pad(x, (0, 0, 0, 1)).T)[:, :1].T  # one row padded to two
    else:
        # Near-equal parts of about ``chunk`` rows, never a lone row: a one-column product takes
        # the matrix-vector path, which streams the weight at half the rate.
        rows = x.shape[0]
        parts = max(1, min(-(-rows // chunk), rows // 2))
        # part.T is the rows' own storage read column-major: no copy before the product.
        y = torch.cat([torch.mm(weight, part.T).T for part in x.tensor_split(parts)])
    y = y.contiguous()
    return y if bias is None else y + bias


class GemmPlan:
    """The form of each product, per weight shape and row count; an empty plan is ``F.linear`` throughout."""

    def __init__(self, chunks: dict[Shape, tuple[int, ...]] | None = None) -> None:
        self.chunks = chunks or {}  # shape -> one entry per ROW_BUCKETS entry (LINEAR or a chunk)
        self._by_rows: dict[int, dict[Shape, int]] = {}

    def forms_for(self, rows: int) -> dict[Shape, int]:
        """The weight shapes to run weight-major for a product of ``rows`` rows, with their chunks."""
        forms = self._by_rows.get(rows)
        if forms is None:
            bucket = row_bucket(rows)
            forms = {}
            if bucket is not None:
                forms = {
                    s: entries[bucket] for s, entries in self.chunks.items() if entries[bucket] != LINEAR
                }
            self._by_rows[rows] = forms
        return forms

    def to_json(self) -> dict[str, list[int]]:
        return {f"{n}x{k}": list(entries) for (n, k), entries in self.chunks.items()}

    @classmethod
    def from_json(cls, data: dict[str, list[int]]) -> "GemmPlan":
        chunks: dict[Shape, tuple[int, ...]] = {}
        for key, entries in data.items():
            n, k = key.split("x")
            if len(entries) != len(ROW_BUCKETS) or any(not isinstance(e, int) or e < 0 for e in entries):
                raise ValueError(f"{key}: expected {len(ROW_BUCKETS)} chunk sizes, got {entries!r}")
            chunks[(int(n), int(k))] = tuple(entries)
        return cls(chunks)


def row_bucket(rows: int) -> int | None:
    """Index of the smallest ROW_BUCKETS entry not below ``rows``; None beyond the last."""
    if rows > ROW_BUCKETS[-1]:
        return None
    return (rows - 1).bit_length()


def plan_for(weights: Iterable[torch.Tensor], enabled: bool = True) -> GemmPlan:
    """The plan for a model's weights: loaded from the cache, or timed now and cached.

    Only CPU weights large enough to matter are considered; on other devices, with
    ``enabled`` false, or with nothing to time, the plan is empty.
    """
    by_shape: dict[Shape, list[torch.Tensor]] = {}
    for w in weights:
        if w.device.type == "cpu" and w.dim() == 2 and w.numel() >= MIN_TUNED_ELEMENTS:
            by_shape.setdefault((w.shape[0], w.shape[1]), []).append(w)
    if not enabled or not by_shape:
        return GemmPlan()
    dtype = next(iter(by_shape.values()))[0].dtype
    path = _cache_path(sorted(by_shape), dtype)
    try:
        return GemmPlan.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):
        pass
    started = time.perf_counter()
    plan = GemmPlan({shape: _time_shape(ws) for shape, ws in by_shape.items()})
    log.info("gemm plan timed in %.1f s: %s", time.perf_counter() - started, plan.to_json())
    keep_timing(path, plan.to_json())
    return plan


def keep_timing(path: Path, data: object) -> None:
    """Write a timing's JSON to ``path`` whole (a reader never sees half of it), or not at all:
    a read-only cache only means timing again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:
        log.info("timing not kept at %s (%s)", path, exc)


def kept_timing(path: Path) -> object | None:
    """The JSON :func:`keep_timing` wrote to ``path``, or None where there is none to read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _time_shape(weights: list[torch.Tensor]) -> tuple[int, ...]:
    """For each row bucket: the fastest form over every weight of this shape.

    Every weight of the shape is multiplied in turn, so the timing streams them from memory as
    a real forward does, rather than finding one weight warm in cache. Weight-major is tried
    whole and in halves and quarters (at least two rows each).
    """
    k = weights[0].shape[1]
    entries = []
    generator = torch.Generator().manual_seed(0)
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, k, generator=generator).to(weights[0].dtype)

        def run(chunk: int, x: torch.Tensor = x) -> float:
            return best_time(lambda: [matmul(x, w, None, chunk) for w in weights])

        linear = run(LINEAR)
        chunks = sorted({max(rows // d, 2) for d in (1, 2, 4)}) if rows > 1 else [1]
        times = {chunk: run(chunk) for chunk in chunks}
        fastest = min(chunks, key=times.__getitem__)
        entries.append(fastest if times[fastest] < MIN_GAIN * linear else LINEAR)
    return tuple(entries)


@torch.inference_mode()
def best_time(run: Callable[[], object], repeats: int = 2) -> float:
    run()  # warm-up: first-call allocations and BLAS setup
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _cache_path(shapes: list[Shape], dtype: torch.dtype, kind: str | None = None) -> Path:
    """Where a timing of ``shapes`` in ``dtype`` on this machine is kept; ``kind`` names timings
    other than a GEMM plan's (the rescored head's passes), kept beside the plans."""
    fields: dict[str, object] = {
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "shapes": shapes,
        "buckets": ROW_BUCKETS,
    }
    if kind is not None:
        fields["kind"] = kind
    key = json.dumps(fields, sort_keys=True)
    return plan_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def timing_path(kind: str, shapes: list[Shape], dtype: torch.dtype) -> Path:
    """Where a timing other than a GEMM plan (``kind``) of ``shapes`` on this machine is kept."""
    return _cache_path(shapes, dtype, kind)


def plan_dir() -> Path:
    """Where timed plans are kept: ``$LIUBAI_GEMM_PLAN_DIR``, else ``gemm/`` in the cache dir."""
    override = os.environ.get(PLAN_DIR_ENV)
    return Path(override) if override else cache_dir() / "gemm"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
