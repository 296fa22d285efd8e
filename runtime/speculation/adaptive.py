"""How many tokens to guess next: more after guesses that all held, fewer after misses, and no
more than the step's measured cost repays.

A miss wastes the rows after it, so the next guess is only one longer than what was accepted;
a fully accepted guess doubles, up to the request's most (``num_draft_tokens``). That bounds
each sequence's guess; :func:`plan_query` then bounds the step's: among the query lengths the
sequences could run, the one that yields the most expected tokens per second of step
(``step_costs.py``), where a sequence guessing ``k`` tokens with per-token acceptance ``a``
expects ``1 + a + ... + a**k`` of them (each guess counts only if all before it held).
"""

from collections.abc import Callable, Sequence

# Each verification's outcome counts this much more than the one before it in the acceptance
# estimate: what a request copies changes (a quoted block ends, prose begins), and the estimate
# must follow within a few guesses.
ACCEPTANCE_DECAY = 0.8
PRIOR_ACCEPTED = 1.0  # pseudo-counts before any guess: an acceptance of one half
PRIOR_REJECTED = 1.0


class DraftLength:
    def __init__(self, most: int) -> None:
        self.most = most
        self.current = most
        self._accepted = PRIOR_ACCEPTED  # decayed counts of guessed tokens that held ...
        self._rejected = PRIOR_REJECTED  # ... and of the misses that ended a guess

    @property
    def acceptance(self) -> float:
        """The chance that a guess holds, given that the ones before it did (decayed estimate)."""
        return self._accepted / (self._accepted + self._rejected)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        missed = num_accepted < num_drafted
        self._accepted = ACCEPTANCE_DECAY * self._accepted + num_accepted
        self._rejected = ACCEPTANCE_DECAY * self._rejected + (1 if missed else 0)
        if not missed:
            self.current = min(self.most, max(self.current, 2 * num_drafted))
        else:
            self.current = max(1, num_accepted + 1)


def expected_tokens(acceptance: float, num_guesses: int) -> float:
    """Tokens a step adds for a sequence guessing ``num_guesses``: its own, plus each guess
    whose predecessors all held (a geometric sum)."""
    if acceptance >= 1.0:
        return 1.0 + num_guesses
    return (1.0 - acceptance ** (num_guesses + 1)) / (1.0 - acceptance)


def plan_query(
    guesses: Sequence[int], acceptances: Sequence[float], cost: Callable[[int], float | None]
) -> int:
    """The query length (1 + most guesses per sequence) that maximises expected tokens per
    second, for a step whose sequences would guess up to ``guesses[i]`` tokens with per-token
    acceptance ``acceptances[i]`` (0 guesses: a sequence that only decodes).

    ``cost(q)`` is the step's measured seconds at query length ``q``, None where not yet
    measured. An unmeasured length is assumed to cost what the longest measured shorter one
    does (the shortest measured one, before any), so it is tried, and then measured, wherever
    that assumption would pick it; with nothing measured every length costs the same and the
    longest wins, as without a plan.
    """
    most = max(guesses, default=0)
    measured = [cost(query) for query in range(1, most + 2)]
    best_query, best_rate = 1, 0.0
    # Lengths before the first measured one: assumed as dear as it.
    seconds = next((s for s in measured if s is not None), 1.0)
    for query, measured_seconds in enumerate(measured, start=1):
        if measured_seconds is not None:
            seconds = measured_seconds
        tokens = sum(expected_tokens(a, min(k, query - 1)) for k, a in zip(guesses, acceptances, strict=True))
        rate = tokens / seconds
        if rate > best_rate:
            best_query, best_rate = query, rate
    return best_query
