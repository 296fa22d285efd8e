"""The rows of liubai's database as values: what the store hands to memory, the agent and the TUI.

One dataclass per table the store reads back (sessions, messages, summaries, compactions) plus a
full-text search hit. ``from_row`` is the one place a SQLite row becomes one of them: integer
flags become bools and JSON id lists become lists.
"""

import json
from dataclasses import dataclass, field, fields
from typing import Any

MESSAGE_STATES = ("live", "summarized", "evicted")


@dataclass(slots=True)
class SessionRecord:
    id: str
    created: str
    updated: str
    model: str
    backend: str
    system: str
    budget_spec: str
    budget_tokens: int
    bytes_per_token: int | None
    k_dtype: str | None
    v_dtype: str | None
    high_watermark: float
    low_watermark: float
    reserve_tokens: int
    summary_id: int | None
    window_start: int
    title: str | None
    token_source: str | None = None  # tokenizer / tiktoken / estimate


@dataclass(slots=True)
class MessageRecord:
    id: int
    session_id: str
    seq: int
    turn: int
    role: str
    kind: str
    content: str
    token_count: int
    state: str
    pinned: bool
    interrupted: bool
    created: str


@dataclass(slots=True)
class SummaryRecord:
    id: int
    session_id: str
    created: str
    text: str
    message_ids: list[int]
    token_count: int
    previous_id: int | None
    depth: int


@dataclass(slots=True)
class CompactionRecord:
    id: int
    session_id: str
    created: str
    trigger: str
    focus: str | None
    tokens_before: int
    tokens_after: int
    dropped_ids: list[int]
    summary_id: int | None
    duration_ms: float
    ledger: list[dict[str, Any]] = field(default_factory=list)  # the facts it kept verbatim
    num_facts_folded: int = 0

    @property
    def num_facts_kept(self) -> int:
        return len(self.ledger)


@dataclass(slots=True)
class SearchHit:
    message_id: int
    turn: int
    role: str
    content: str
    state: str
    rank: float

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def from_row(cls: type, row: dict[str, Any]) -> Any:
    """A row of the store as ``cls``: flags as bools, id lists parsed from their JSON."""
    values = {}
    for f in fields(cls):
        value = row.get(f.name)
        if f.name in ("pinned", "interrupted"):
            value = bool(value)
        elif f.name in ("message_ids", "dropped_ids", "ledger"):
            value = json.loads(value or "[]")
        elif f.name == "num_facts_folded":
            value = value or 0
        values[f.name] = value
    return cls(**values)
