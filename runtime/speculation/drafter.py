"""What every drafter offers the engine, and the defaults speculation runs with.

A drafter proposes, for each decoding sequence, up to ``k`` tokens that it guesses follow the
sequence's tokens so far. Guesses are deterministic (a point mass), so one verification rule
serves every drafter: greedy keeps the longest prefix equal to the model's argmax, sampling
accepts a guess with the model's own probability of it (``verify.py``).
"""

from collections.abc import Sequence as SequenceOf
from typing import Protocol

from runtime.engine.sequence import Sequence

DEFAULT_NUM_DRAFT_TOKENS = 5
# Above this many running sequences a step reads the weights for enough rows already, and the
# extra rows of verification cost more than the tokens they win: bench.spec's batch sweep, per
# (weight format, compiled step). Eager steps carry enough fixed cost that guessing still paid
# at batch 8 (bfloat16, float32 on the Intel Xeon; int4 on the AMD EPYC, 1.08-2.92x). The
# compiled int4 step, the cheapest one-row step, read 0.79-0.84x at 4 and 8 while its
# verification rows each gathered the whole context, and 1.15-2.05x at 1-8 once they shared one
# gather (AMD EPYC, 81ee579): no (format, compiled) pair needs a bound of its own today.
SPECULATE_MAX_BATCH: dict[tuple[str, bool], int] = {}
DEFAULT_SPECULATE_MAX_BATCH = 4


def measured_max_batch(weight_format: str, compiled: bool) -> int:
    """The most running sequences that still guess, by default, for this format and step."""
    return SPECULATE_MAX_BATCH.get((weight_format, compiled), DEFAULT_SPECULATE_MAX_BATCH)


class Drafter(Protocol):
    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[list[int]]:
        """Up to ``num_tokens[i]`` guessed tokens to follow ``seqs[i].token_ids``; [] for no guess."""
        ...

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished: drop whatever the drafter keeps for it."""
        ...

    def reset_prefix_cache(self) -> None:
        """The engine forgets its cached prefixes: forget any the drafter keeps too."""
        ...
