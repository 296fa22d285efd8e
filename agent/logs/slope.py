"""``liubai logs slope``: how a request's cost grows with the context it runs in.

Short sessions are prefill-bound and flat; long ones pay more per token as the KV cache grows.
From the stored requests this fits four straight lines against context length by ordinary least
squares, each with its R², its number of points and the standard error of its slope:

- prefill ms per prefilled token and decode ms per decoded token, one point per request;
- compute seconds per turn and, when the session was priced, dollars per turn, one point per turn.

The context (x) is a request's ``prompt_tokens``: what the KV cache holds when the request starts,
the same x for every metric and for the short/long threshold. ``kv_tokens`` adds the request's own
reply, so it would move each decode point's x by the very tokens being timed. A turn's context
is that of its largest request.

Summary (compaction) requests stay out of the per-request fits, since their prompt is the text
being summarized and not the conversation, but their compute and dollars count in the cost of the
turn that triggered them (requests carry ``turn``). Interrupted turns stay out of the per-turn
fits, since they did not run to the end. A session is *long* when its largest context exceeds the
threshold; the report fits short sessions, long sessions and all of them. A line needs
``MIN_POINTS`` points at two or more context lengths (the slope's standard error divides by
n - 2); with fewer the report says so instead of fitting.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.logs.defaults import DEFAULT_THRESHOLD
from memory.store import Store

MIN_POINTS = 3
GROUPS = ("short", "long", "all")
# metric -> (label, what one point is)
METRICS = {
    "prefill_ms_per_token": ("prefill ms/token", "request"),
    "decode_ms_per_token": ("decode ms/token", "request"),
    "compute_s_per_turn": ("compute s/turn", "turn"),
    "usd_per_turn": ("$/turn", "turn"),
}
PLOT_METRIC = "decode_ms_per_token"
PLOT_WIDTH = 40
MAX_BUCKETS = 8
_EIGHTHS = " ▏▎▍▌▋▊▉"


@dataclass(slots=True, frozen=True)
class LineFit:
    """``y = intercept + slope * x``, fitted to ``n`` points."""

    slope: float
    intercept: float
    r2: float
    n: int
    slope_stderr: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit | None:
    """Least-squares line through the points; None with fewer than 3 or with every x equal."""
    if len(xs) != len(ys):
        raise ValueError(f"fit_line needs as many xs as ys, got {len(xs)} and {len(ys)}")
    n = len(xs)
    if n < MIN_POINTS:
        return None
    x_mean = math.fsum(xs) / n
    y_mean = math.fsum(ys) / n
    sxx = math.fsum((x - x_mean) ** 2 for x in xs)
    if sxx == 0:
        return None
    sxy = math.fsum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = y_mean - slope * x_mean
    ss_res = math.fsum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = math.fsum((y - y_mean) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0  # every y equal: the flat line is exact
    return LineFit(slope, intercept, r2, n, math.sqrt(ss_res / (n - 2) / sxx))


@dataclass(slots=True, frozen=True)
class MetricFit:
    """One metric's line in one group, or why there is none."""

    n: int
    fit: LineFit | None
    why_none: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "fit": self.fit.to_dict() if self.fit else None, "why_none": self.why_none}


@dataclass(slots=True)
class GroupFits:
    session_ids: list[str]
    num_turns: int
    fits: dict[str, MetricFit]

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_ids": self.session_ids,
            "num_turns": self.num_turns,
            "fits": {name: f.to_dict() for name, f in self.fits.items()},
        }


@dataclass(slots=True, frozen=True)
class Bucket:
    """The mean of a metric over the points whose context lies in ``[lo, hi]``."""

    lo: int
    hi: int
    n: int
    mean: float


@dataclass(slots=True)
class SlopeReport:
    threshold: int
    max_context: dict[str, int]  # session id -> its largest context, in report order
    groups: dict[str, GroupFits]
    buckets: list[Bucket] = field(default_factory=list)  # PLOT_METRIC by context, every session

    def fit(self, metric: str, group: str = "all") -> LineFit | None:
        return self.groups[group].fits[metric].fit

    @property
    def has_fit(self) -> bool:
        return any(f.fit is not None for g in self.groups.values() for f in g.fits.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": "prompt_tokens",
            "threshold_tokens": self.threshold,
            "min_points": MIN_POINTS,
            "sessions": [
                {"id": sid, "max_context_tokens": ctx, "long": ctx > self.threshold}
                for sid, ctx in self.max_context.items()
            ],
            "groups": {name: g.to_dict() for name, g in self.groups.items()},
            "plot": {"metric": PLOT_METRIC, "buckets": [asdict(b) for b in self.buckets]},
        }


# -- from requests to points ----------------------------------------------------------------

Points = dict[str, list[tuple[float, float]]]  # metric -> (context, value)


@dataclass(slots=True)
class _Turn:
    context: int | None = None
    compute_s: float = 0.0
    usd: float = 0.0
    priced: bool = True
    interrupted: bool = False


@dataclass(slots=True)
class _SessionPoints:
    max_context: int
    num_turns: int
    points: Points


def _session_points(rows: Iterable[dict[str, Any]]) -> _SessionPoints:
    points: Points = {name: [] for name in METRICS}
    turns: dict[int, _Turn] = {}
    for r in rows:
        turn = turns.setdefault(r["turn"] or 0, _Turn())
        turn.compute_s += r["compute_s"] or 0.0
        if r["cost_usd"] is None:
            turn.priced = False
        else:
            turn.usd += r["cost_usd"]
        context = r["prompt_tokens"]
        if r["kind"] == "summary" or context is None:
            continue
        turn.context = max(turn.context or 0, context)
        turn.interrupted = turn.interrupted or bool(r["interrupted"])
        prefilled, generated = r["prefilled_tokens"] or 0, r["generated_tokens"] or 0
        if prefilled > 0 and r["prefill_ms"] is not None:
            points["prefill_ms_per_token"].append((context, r["prefill_ms"] / prefilled))
        if generated >= 2 and r["decode_ms"] is not None:  # decode_ms spans generated - 1 tokens
            points["decode_ms_per_token"].append((context, r["decode_ms"] / (generated - 1)))
    for t in turns.values():
        if t.context is not None and not t.interrupted:
            points["compute_s_per_turn"].append((t.context, t.compute_s))
            if t.priced:
                points["usd_per_turn"].append((t.context, t.usd))
    contexts = [t.context for t in turns.values() if t.context is not None]  # answered turns only
    return _SessionPoints(max(contexts, default=0), len(contexts), points)


def _metric_fit(metric: str, points: list[tuple[float, float]]) -> MetricFit:
    fit = fit_line([x for x, _ in points], [y for _, y in points])
    why = None
    if fit is None:
        if not points:
            why = "not priced" if metric == "usd_per_turn" else "no data"
        elif len(points) < MIN_POINTS:
            why = (
                f"{len(points)} point{'s' if len(points) > 1 else ''}: too few for a fit (need {MIN_POINTS})"
            )
        else:
            why = "every point at one context length: no slope"
    return MetricFit(len(points), fit, why)


def _buckets(points: list[tuple[float, float]]) -> list[Bucket]:
    if not points:
        return []
    width = 64
    while max(x for x, _ in points) // width >= MAX_BUCKETS:
        width *= 2
    bins: dict[int, list[float]] = {}
    for x, y in points:
        bins.setdefault(int(x // width), []).append(y)
    return [
        Bucket(i * width, (i + 1) * width - 1, len(ys), math.fsum(ys) / len(ys))
        for i, ys in sorted(bins.items())
    ]


def slope_report(store: Store, session_ids: Sequence[str], threshold: int = DEFAULT_THRESHOLD) -> SlopeReport:
    """Fit every metric for the short, the long and all of ``session_ids``.

    Raises ``SessionNotFoundError`` for an id that is not stored, ``ValueError`` for a negative
    threshold.
    """
    if threshold < 0:
        raise ValueError(f"--threshold must be >= 0 tokens, got {threshold}")
    sessions: dict[str, _SessionPoints] = {}
    for sid in session_ids:
        store.get_session(sid)
        sessions[sid] = _session_points(store.requests(sid))
    groups = {}
    for group in GROUPS:
        members = [
            sid
            for sid, s in sessions.items()
            if group == "all" or (s.max_context > threshold) == (group == "long")
        ]
        fits = {
            metric: _metric_fit(metric, [p for sid in members for p in sessions[sid].points[metric]])
            for metric in METRICS
        }
        groups[group] = GroupFits(members, sum(sessions[sid].num_turns for sid in members), fits)
    every = [p for s in sessions.values() for p in s.points[PLOT_METRIC]]
    return SlopeReport(
        threshold, {sid: s.max_context for sid, s in sessions.items()}, groups, _buckets(every)
    )


def session_slope(store: Store, session_id: str, threshold: int = DEFAULT_THRESHOLD) -> SlopeReport | None:
    """One session's slopes, or None while it has too few turns for any line."""
    report = slope_report(store, [session_id], threshold)
    return report if report.has_fit else None


# -- text -----------------------------------------------------------------------------------


def _bar(value: float, top: float) -> str:
    eighths = round(PLOT_WIDTH * 8 * value / top) if top > 0 else 0
    full, part = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[part] if part else "")).ljust(PLOT_WIDTH)


def _header(report: SlopeReport) -> str:
    t = f"{report.threshold:,}"
    if len(report.max_context) == 1:
        sid, ctx = next(iter(report.max_context.items()))
        kind = "long" if ctx > report.threshold else "short"
        return f"session {sid}: {kind} (largest context {ctx:,} tokens; long means > {t})"
    num_long = len(report.groups["long"].session_ids)
    num_short = len(report.groups["short"].session_ids)
    num = len(report.max_context)
    return f"{num} sessions: {num_short} short, {num_long} long (largest context > {t} tokens)"


def _table(report: SlopeReport) -> list[str]:
    shown = [g for g in ("short", "long") if report.groups[g].session_ids]
    if len(shown) != 1:
        shown.append("all")  # with only short (or only long) sessions, "all" would repeat them
    headers = ["metric", "sessions", "turns", "n", "at 0 ctx", "per 1k ctx", "± se", "R²"]
    rows: list[list[str]] = []
    for metric, (label, _) in METRICS.items():
        for i, group in enumerate(shown):
            g = report.groups[group]
            mf = g.fits[metric]
            head = [label if i == 0 else "", group, str(g.num_turns), str(mf.n)]
            if mf.fit is None:
                rows.append([*head, f"{mf.why_none}"])
            else:
                f = mf.fit
                rows.append(
                    [
                        *head,
                        f"{f.intercept:.4g}",
                        f"{f.slope * 1000:+.4g}",
                        f"{f.slope_stderr * 1000:.2g}",
                        f"{f.r2:.3f}",
                    ]
                )
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r if len(r) == len(headers) else r[:-1]):
            widths[i] = max(widths[i], len(cell))

    def line(cells: list[str]) -> str:
        fitted = len(cells) == len(headers)  # otherwise the last cell says why there is no fit
        aligned = cells if fitted else cells[:-1]
        text = "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(aligned, widths, strict=False))
        )
        return (text if fitted else f"{text}  {cells[-1]}").rstrip()

    return [line(headers), *(line(r) for r in rows)]


def _plot(report: SlopeReport) -> list[str]:
    label = METRICS[PLOT_METRIC][0]
    if not report.buckets:
        return [f"{label} by context: no requests generated 2 or more tokens"]
    top = max(b.mean for b in report.buckets)
    ranges = [f"{b.lo:,}–{b.hi:,}" for b in report.buckets]
    width = max(len(r) for r in ranges)
    lines = [f"{label} by context (tokens; bars from 0)"]
    for r, b in zip(ranges, report.buckets, strict=True):
        lines.append(f"  {r.rjust(width)}  {_bar(b.mean, top)}  {b.mean:8.3f}  n={b.n}")
    return lines


def render_slope(report: SlopeReport) -> str:
    """The report as text: a header, the table of fits and a bar chart of decode ms/token."""
    if not report.max_context:
        return "no sessions to fit\n"
    lines = [_header(report), "x = context (prompt tokens); slope per 1,000 context tokens", ""]
    lines += _table(report)
    lines += ["", *_plot(report)]
    if not report.has_fit:
        lines += ["", f"no fit: fewer than {MIN_POINTS} usable points at two or more context lengths"]
    return "\n".join(lines) + "\n"
