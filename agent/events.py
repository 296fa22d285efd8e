"""The agent's event stream: everything a turn does, as small value objects.

One stream feeds every consumer: the headless writer prints it (``--jsonl``) or folds it into one
result (``--json``), and the TUI renders it. Each event is a frozen dataclass with a ``type``
tag and a ``to_dict()`` that is its JSON form, so a consumer never reaches into the loop.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class Event:
    type: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **asdict(self)}


@dataclass(frozen=True, slots=True)
class TurnStarted(Event):
    """A request is about to run: the prompt the context manager built for it."""

    type: ClassVar[str] = "turn_start"
    session_id: str
    turn: int
    round: int  # 0 for the user's message, 1.. for each tool round that follows
    prompt_tokens: int
    sections: dict[str, int]
    budget_tokens: int
    recalled: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TokenDelta(Event):
    """Reply text as it streams (tool-call markup held back)."""

    type: ClassVar[str] = "token"
    turn: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCalled(Event):
    type: ClassVar[str] = "tool_call"
    turn: int
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolFinished(Event):
    type: ClassVar[str] = "tool_result"
    turn: int
    name: str
    ok: bool
    refused: bool
    truncated: bool
    content: str
    duration_ms: float


@dataclass(frozen=True, slots=True)
class Compacted(Event):
    """Old turns left the live context (``compaction`` is ``CompactionEvent.to_dict()``)."""

    type: ClassVar[str] = "compaction"
    turn: int
    compaction: dict[str, Any]

    @property
    def description(self) -> str:
        return str(self.compaction.get("description", "compacted"))


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    """One engine request ended (a turn with tool rounds makes several)."""

    type: ClassVar[str] = "request"
    turn: int
    kind: str  # turn / tool / summary
    metrics: dict[str, Any]
    kv: dict[str, Any]
    cost: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TurnFinished(Event):
    """The turn's answer, with what it cost and where the KV budget stands."""

    type: ClassVar[str] = "turn_end"
    session_id: str
    turn: int
    answer: str
    finish_reason: str | None
    interrupted: bool
    usage: dict[str, int]
    timings: dict[str, float]
    kv: dict[str, Any]
    cost: dict[str, Any]
    num_tool_rounds: int


@dataclass(frozen=True, slots=True)
class ErrorOccurred(Event):
    type: ClassVar[str] = "error"
    message: str
    turn: int | None = None
