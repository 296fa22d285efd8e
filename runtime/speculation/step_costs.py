"""What a decode or verification step costs on this machine, by its shape, as measured while serving.

How much a step's extra rows cost depends on the CPU and the weight format. ATen's int4 kernel
streams the weights once per block of 4 rows, so on an AMD EPYC Zen 5 (AVX-512) a compiled
int4 step of 4 rows cost 1.4 times one of 1 and a step of 6 rows 2.0 times (2026-12-07); on an
AVX2 EPYC (Zen 3) 4 rows cost 1.33 times and 6 rows 2.3 to 2.5 times. An earlier AVX-512 EPYC
reading had 6 rows at little more than one. Whether guessing 5 tokens pays therefore differs by
machine, so the draft length is chosen against these costs (``adaptive.py``), and they are
measured, never assumed.

A shape is (sequences, query rows per sequence) as the step runs it: a compiled step's graph
bucket, the eager step's own numbers. Each shape keeps its most recent :data:`WINDOW` wall
times and is estimated by their median, which shrugs off a neighbour's burst on a shared VM
and follows a context that grows (attention's share of a step grows with it).
"""

import statistics
from collections import deque

Shape = tuple[int, int]  # (sequences, query rows per sequence)

WINDOW = 8  # recent steps per shape the estimate is the median of
MIN_STEPS = 3  # a shape is estimated only after this many steps; before, the planner assumes it cheap


class StepCosts:
    def __init__(self) -> None:
        self._seconds: dict[Shape, deque[float]] = {}
        # Each shape's median, kept current by observe: the planner reads it several times a step.
        self._estimates: dict[Shape, float] = {}

    def observe(self, shape: Shape, seconds: float) -> None:
        recent = self._seconds.setdefault(shape, deque(maxlen=WINDOW))
        recent.append(seconds)
        if len(recent) >= MIN_STEPS:
            self._estimates[shape] = statistics.median(recent)

    def estimate(self, shape: Shape) -> float | None:
        """The median of the shape's recent wall times, or None until it has run :data:`MIN_STEPS` times."""
        return self._estimates.get(shape)

    def snapshot(self) -> dict[str, float]:
        """Each estimated shape's cost in ms under ``"SxQ"``, for stats and benchmarks."""
        return {f"{s}x{q}": round(seconds * 1000, 2) for (s, q), seconds in sorted(self._estimates.items())}

    def clear(self) -> None:
        self._seconds.clear()
        self._estimates.clear()
