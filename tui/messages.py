"""Textual messages: how the agent's events reach the chat screen, and how commands reach it.

A turn runs on a worker thread and never touches a widget. Every agent event becomes one of these
messages (``post_message`` is thread-safe) and the chat screen's handlers update the widgets on
the UI thread. Events after which the context has changed (a request starting, a compaction, a
turn ending) carry a :class:`ContextSnapshot` taken on the worker thread at that moment, so the
UI never reads the context manager while the loop is changing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.message import Message

from agent.events import (
    Compacted,
    ErrorOccurred,
    Event,
    RequestFinished,
    TokenDelta,
    ToolCalled,
    ToolFinished,
    TurnFinished,
    TurnStarted,
)
from memory.context_manager import TurnInfo
from tui.commands import SlashCommand

if TYPE_CHECKING:
    from agent.session import AgentSession


@dataclass(frozen=True, slots=True)
class ContextSnapshot:
    """The context as one moment left it: the turn map and where the budget stands."""

    turns: tuple[TurnInfo, ...]
    context_tokens: int
    budget_tokens: int
    budget_text: str
    bytes_per_token: int | None
    k_dtype: str | None
    v_dtype: str | None

    @classmethod
    def of(cls, session: AgentSession) -> ContextSnapshot:
        context = session.context
        k_dtype, v_dtype = session.backend.kv_dtypes
        return cls(
            tuple(context.turn_map()),
            context.context_tokens(),
            context.budget.tokens,
            context.budget.spec.text,
            context.budget.bytes_per_token,
            k_dtype,
            v_dtype,
        )


# -- the agent's events ------------------------------------------------------------------------


@dataclass
class RequestBegan(Message):
    """A request's prompt is built (``event.prompt_tokens`` are in the KV from now on)."""

    event: TurnStarted
    context: ContextSnapshot


@dataclass
class ReplyDelta(Message):
    event: TokenDelta


@dataclass
class ToolCallStarted(Message):
    event: ToolCalled


@dataclass
class ToolCallFinished(Message):
    event: ToolFinished


@dataclass
class CompactionNoticed(Message):
    event: Compacted
    context: ContextSnapshot


@dataclass
class RequestDone(Message):
    """One engine request ended (a turn's, a tool round's, or a summary's)."""

    event: RequestFinished


@dataclass
class TurnEnded(Message):
    event: TurnFinished
    context: ContextSnapshot


@dataclass
class AgentFailed(Message):
    """An error to show as a notification; ``detail`` is a traceback for the log, if any."""

    message: str
    detail: str | None = None


@dataclass
class JobDone(Message):
    """The worker is free again: a turn or a compaction ended, however it ended."""

    job: str  # "turn" or "compact"
    interrupted: bool
    context: ContextSnapshot
    note: str | None = None  # an outcome worth a notification ("nothing to compact")


def message_for(event: Event, session: AgentSession) -> Message | None:
    """The message that carries ``event`` to the UI (called on the worker thread)."""
    if isinstance(event, TokenDelta):
        return ReplyDelta(event)
    if isinstance(event, TurnStarted):
        return RequestBegan(event, ContextSnapshot.of(session))
    if isinstance(event, ToolCalled):
        return ToolCallStarted(event)
    if isinstance(event, ToolFinished):
        return ToolCallFinished(event)
    if isinstance(event, Compacted):
        return CompactionNoticed(event, ContextSnapshot.of(session))
    if isinstance(event, RequestFinished):
        return RequestDone(event)
    if isinstance(event, TurnFinished):
        return TurnEnded(event, ContextSnapshot.of(session))
    if isinstance(event, ErrorOccurred):
        return AgentFailed(event.message)
    return None


# -- commands ----------------------------------------------------------------------------------


@dataclass
class CommandChosen(Message):
    """Run a slash command (from the command palette)."""

    command: SlashCommand


@dataclass
class PrefillInput(Message):
    """Put text into the chat input, for a command that still needs its argument."""

    text: str
