"""The turn map: each user turn of a session and what became of it (live, summarized, evicted).

The TUI's turn-map widget draws it; a turn counts as live while any of its messages is.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from memory.records import MessageRecord


@dataclass(slots=True)
class TurnInfo:
    """One row of the turn map: a user turn and what became of it."""

    turn: int
    state: str  # live / summarized / evicted
    pinned: bool
    tokens: int
    preview: str


def turn_map_of(messages: Sequence[MessageRecord]) -> list[TurnInfo]:
    """One row per conversation turn (turn 0 and recall notes are not turns), in order."""
    turns: dict[int, TurnInfo] = {}
    for m in messages:
        if m.kind != "chat" or m.turn == 0:
            continue
        info = turns.get(m.turn)
        if info is None:
            preview = " ".join(m.content.split())[:60]
            info = turns[m.turn] = TurnInfo(m.turn, m.state, m.pinned, 0, preview)
        info.tokens += m.token_count
        info.pinned = info.pinned or m.pinned
        if m.state == "live":
            info.state = "live"
    return [turns[t] for t in sorted(turns)]
