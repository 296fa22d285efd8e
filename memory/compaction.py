"""One compaction: what left the live context, what replaced it, and what it cost.

The context manager builds a ``CompactionEvent`` when old turns leave the live context (which
turns: ``memory/eviction.py``; their summary: ``memory/summarizer.py``); the store records it,
in one transaction, before the live context changes; the agent's event stream carries its
``to_dict()``, whose keys the logs, the TUI and headless JSON read.
"""

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionEvent:
    """One compaction: built by the context manager, recorded by the store, seen by the TUI."""

    session_id: str
    trigger: str  # auto / manual / clear
    focus: str | None
    turns: list[int]  # the user turns that left the live context, in order (never empty)
    tokens_before: int
    tokens_after: int
    summarized_ids: list[int]  # folded into the new summary
    evicted_ids: list[int]  # dropped without summarizing: recall notes, and everything on clear
    summary_text: str | None  # the new summary; None when there is none (clear)
    summary_message_ids: list[int] = field(default_factory=list)  # all the new summary covers
    summary_tokens: int = 0
    summary_depth: int = 0
    previous_summary_id: int | None = None
    window_start: int  # seq where the recent section starts afterwards
    num_requests: int = 0  # summarization requests it made
    # The fact ledger's facts the new summary's kept-verbatim list carries (``Fact.to_dict()``),
    # and how many of the summary's facts were folded out of the list for room (still stored).
    ledger: list[dict[str, Any]] = field(default_factory=list)
    num_facts_folded: int = 0
    duration_ms: float
    # Given by the store when it records the compaction (``Store.record_compaction``).
    compaction_id: int = 0
    summary_id: int | None = None  # the session's summary afterwards

    @property
    def first_turn(self) -> int:
        return self.turns[0]

    @property
    def last_turn(self) -> int:
        return self.turns[-1]

    def describe(self) -> str:
        span = (
            f"turn {self.first_turn}"
            if self.first_turn == self.last_turn
            else (f"turns {self.first_turn}–{self.last_turn}")
        )
        verb = "cleared" if self.trigger == "clear" else "compacted"
        text = f"{verb} {span}: {self.tokens_before:,} → {self.tokens_after:,} tokens"
        if self.ledger:
            text += f", kept {describe_facts(len(self.ledger))} verbatim"
        return text

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
            "facts_kept": len(self.ledger),
            "facts_folded": self.num_facts_folded,
            "ledger": self.ledger,
            "duration_ms": round(self.duration_ms, 3),
            "compaction_id": self.compaction_id,
            "summary_id": self.summary_id,
            "description": self.describe(),
        }


def describe_facts(count: int) -> str:
    return f"{count} fact" if count == 1 else f"{count} facts"


def elapsed_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000
