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
# extra rows of verification cost more than the tokens they win (see bench.spec's batch sweep).
# Every format and step swept gains up to 8: bfloat16 and float32 eager on the Intel Xeon, int4
# eager and compiled on the AMD EPYC (compiled 1.15-2.05x at 1-8 since its verification rows
# share one context gather, 81ee579; 0.79-0.84x at 4 and 8 before).
DEFAULT_SPECULATE_MAX_BATCH = 4


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
