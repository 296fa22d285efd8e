"""What ``--weights auto`` runs on a CPU: the fastest weight format here that keeps the model's quality.

Which format decodes fastest depends on the machine (the matrix units, the memory bandwidth,
how torch's kernels treat them), so it is measured on the machine, once, like the GEMM plan
(``runtime/layers/gemm.py``): each format of :data:`CANDIDATES` gets an engine of its own, whose
quality is scored against float32 weights over :data:`~runtime.engine.scoring.HELD_TOKENS`
tokens of the held text (``scoring.py``) and, if that quality can be chosen, whose batch-1
greedy decode is timed (eager, no speculation, best of :data:`TIMED_RUNS`). The choice is the
fastest format within KLD <= 1e-3 and top-1 agreement >= 0.98 (float32, the reference, always
is), where a less precise format must be at least :data:`MARGIN` (5%) faster than the more
precise one it displaces. Eager, not compiled: compiling every format would cost minutes, and
the compiled step kept the eager order on the machines measured (bench.decode, README).

The plan is a JSON file in ``weight-plan/`` under liubai's cache dir (or
``$LIUBAI_WEIGHT_PLAN_DIR``), keyed by the model's files, the CPU, torch and the thread count,
and holds every format's figures; measuring takes about a minute the first time (float32's GEMM
plan is timed and the quantized weights filed on the way, so later loads in those formats are
quicker too).

The plan applies only where nothing else decides: ``weights`` and ``dtype`` both ``auto``, the
lean forward, a CPU. A named ``--dtype`` keeps that dtype's float weights; CUDA keeps bfloat16.
"""

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from runtime.engine.sampling import SamplingParams
from runtime.engine.scoring import HELD_TOKENS, MAX_KLD, MIN_TOP1, Quality, held_token_ids, quality
from runtime.layers.gemm import keep_timing
from runtime.layers.weights import QUANTIZED_FORMATS
from runtime.paths import cache_dir

log = logging.getLogger(__name__)

CANDIDATES = ("float32", "bfloat16", "int8", "int4")
PROMPT_TOKENS = 64  # the timed decode's context (of the held text)
TIMED_TOKENS = 32  # greedy tokens per timed run
TIMED_RUNS = 3  # the first warms the engine up; the best of the rest counts
PLAN_VERSION = 1  # bump when the measurement changes, so older plans are measured again
# How much faster a less precise format must decode to be chosen over a more precise one.
MARGIN = 0.05
# Each trial engine's options besides the format: a small pool, no guessing (speed is the
# format's own), no prefix cache (every timed run prefills; only decode is timed).
TRIAL_OPTIONS: dict[str, Any] = {
    "kv_pool": "32MiB",
    "device": "cpu",
    "speculate": "off",
    "enable_prefix_caching": False,
}


@dataclass(frozen=True, slots=True)
class FormatFigures:
    format: str
    decode_tok_s: float | None  # None: not timed, its quality already rules it out
    kld_mean: float
    top1_agree: float
    ppl_delta_pct: float

    @property
    def within_bounds(self) -> bool:
        return self.kld_mean <= MAX_KLD and self.top1_agree >= MIN_TOP1

    @property
    def eligible(self) -> bool:
        """Whether :func:`choose` may pick it: float32, the reference, always is."""
        return self.within_bounds or self.format == "float32"

    @property
    def rate(self) -> float:
        return self.decode_tok_s or 0.0


@dataclass(frozen=True, slots=True)
class WeightPlan:
    choice: str
    rows: tuple[FormatFigures, ...]
    path: Path  # where it is (or would have been) kept

    def describe(self) -> str:
        """One line: the choice and why, for notices and the README's claims."""
        by_format = {row.format: row for row in self.rows}
        chosen, reference = by_format[self.choice], by_format["float32"]
        speedup = chosen.rate / reference.rate if reference.rate else 0.0
        return (
            f"weights auto: {self.choice} ({chosen.rate:.1f} tok/s, {speedup:.2f}x float32's "
            f"{reference.rate:.1f}; KLD {chosen.kld_mean:.1e}, top-1 {chosen.top1_agree:.3f})"
        )


def choose(rows: list[FormatFigures] | tuple[FormatFigures, ...]) -> str:
    """The fastest format within the quality bounds (float32, the reference, is by definition),
    where a less precise format must be :data:`MARGIN` faster than the more precise one it displaces.

    Without the margin two formats of equal speed were picked by the timing noise of the moment
    (bfloat16 or float32 on a tiny model: one fresh clone's run chose each), so a rerun could
    change the weights, the KV capacity and every figure that depends on them. Formats are taken
    in :data:`CANDIDATES` order, most precise first.
    """
    eligible = [row for row in rows if row.eligible]
    # A kept plan naming a format not in CANDIDATES raises ValueError here: it is measured again.
    eligible.sort(key=lambda row: CANDIDATES.index(row.format))
    chosen = eligible[0]
    for row in eligible[1:]:
        if row.rate > chosen.rate * (1 + MARGIN):
            chosen = row
    return chosen.format


def plan_dir() -> Path:
    override = os.environ.get("LIUBAI_WEIGHT_PLAN_DIR")
    return Path(override) if override else cache_dir() / "weight-plan"


def plan_path(model_path: Path) -> Path:
    """Where the plan for the model at ``model_path`` on this machine is kept."""
    return plan_dir() / f"{_key(model_path)}.json"


def weight_plan(
    model_path: Path, open_engine: Callable[[str, bool], Any], on_notice: Callable[[str], None]
) -> WeightPlan:
    """The plan for the model at ``model_path`` on this machine: read back, or measured now (each
    format in an engine ``open_engine(format, tune_gemm)`` builds with :data:`TRIAL_OPTIONS`) and kept."""
    path = plan_path(model_path)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            stored = tuple(FormatFigures(**row) for row in data["rows"])
            # Every format the rule may pick must have been timed (a looser bound than the one
            # that skipped a format's timing measures again).
            timed = all(row.decode_tok_s is not None for row in stored if row.eligible)
            if "float32" in {row.format for row in stored} and timed:
                # Chosen again from the figures, so a change of rule needs no new measurement.
                return WeightPlan(choose(stored), stored, path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("weight plan %s unreadable (%s); measuring again", path, exc)
    on_notice(
        f"weights auto: timing {', '.join(CANDIDATES)} on this CPU (once for this model, about a minute)"
    )
    started = time.perf_counter()
    rows = measure(open_engine)
    plan = WeightPlan(choose(rows), tuple(rows), path)
    keep_timing(path, {"choice": plan.choice, "rows": [asdict(row) for row in rows]})
    on_notice(f"{plan.describe()}; measured in {time.perf_counter() - started:.0f} s")
    return plan


def measure(
    open_engine: Callable[[str, bool], Any], formats: tuple[str, ...] = CANDIDATES
) -> list[FormatFigures]:
    """Each format's quality against float32 weights and, where that quality can be chosen, its
    batch-1 decode speed, on this machine.

    ``open_engine(format, tune_gemm)`` is an ``Engine`` of the model in that format, its products'
    forms timed (gemm.py) or not (passed in, not built here, so that the engine, which asks for
    this plan, is not imported by it). A float format other than the reference is first scored
    untuned: timing its GEMM plan costs half a minute on a CPU without bfloat16 units, wasted
    where the format's quality rules it out (bfloat16 on the default model, top-1 0.977), and the
    forms change only the rounding. Quantized formats have no plan to time.
    """
    params = SamplingParams(max_tokens=TIMED_TOKENS, temperature=0.0, ignore_eos=True)
    reference: torch.Tensor | None = None
    rows = []
    for fmt in ("float32", *(f for f in formats if f != "float32")):
        scored_untuned = fmt not in QUANTIZED_FORMATS and fmt != "float32"
        engine = open_engine(fmt, not scored_untuned)
        ids = held_token_ids(engine.tokenizer, HELD_TOKENS)
        logits = engine.prompt_logits(ids)
        if reference is None:
            reference = logits
        score: Quality = quality(reference, logits, ids)
        row = FormatFigures(fmt, None, score.kld_mean, round(score.top1_agree, 4), score.ppl_delta_pct)
        if row.eligible:
            if scored_untuned:
                del engine
                engine = open_engine(fmt, True)
            rates = []
            for _ in range(TIMED_RUNS):
                metrics = engine.generate([ids[:PROMPT_TOKENS]], params)[0].metrics
                rates.append((metrics.num_generated_tokens - 1) / (metrics.decode_ms / 1000))
            row = replace(row, decode_tok_s=round(max(rates[1:]), 2))
        rows.append(row)
        log.info("weights auto: %s", row)
        del engine
    return [row for row in rows if row.format in formats]


def _key(model_path: Path) -> str:
    """The model's files (names, sizes, times), the CPU, torch and threads: what the figures depend on."""
    files = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_path.iterdir() if p.is_file()
    )
    key = json.dumps(
        {
            "version": PLAN_VERSION,
            "model": str(model_path.resolve()),
            "files": files,
            "cpu": _cpu_name(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
