"""One compaction: what left the live context, what replaced it, and what it cost.

The context manager builds a ``CompactionEvent`` when old turns leave the live context (their
summary written by ``memory/summarizer.py``); the agent's event stream carries its ``to_dict()``.
"""

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompactionEvent:
    """One compaction, as the agent's event stream and the TUI see it."""

    trigger: str  # auto / manual / clear
    focus: str | None
    first_turn: int
    last_turn: int
    tokens_before: int
    tokens_after: int
    summarized_ids: list[int]
    evicted_ids: list[int]
    summary_tokens: int
    summary_depth: int
    num_requests: int
    duration_ms: float
    compaction_id: int = 0
    summary_id: int | None = None
    turns: list[int] = field(default_factory=list)

    def describe(self) -> str:
        span = (
            f"turn {self.first_turn}"
            if self.first_turn == self.last_turn
            else (f"turns {self.first_turn}–{self.last_turn}")
        )
        verb = "cleared" if self.trigger == "clear" else "compacted"
        return f"{verb} {span}: {self.tokens_before:,} → {self.tokens_after:,} tokens"

    def to_dict(self) -> dict[str, Any]:
        return {
            "trigger": self.trigger,
            "focus": self.focus,
            "turns": self.turns,
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "summarized_ids": self.summarized_ids,
            "evicted_ids": self.evicted_ids,
            "summary_tokens": self.summary_tokens,
            "summary_depth": self.summary_depth,
            "num_requests": self.num_requests,
            "duration_ms": round(self.duration_ms, 3),
            "compaction_id": self.compaction_id,
            "summary_id": self.summary_id,
            "description": self.describe(),
        }


def elapsed_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000
