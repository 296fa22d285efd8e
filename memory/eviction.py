"""The eviction policy: which messages leave the live context at a compaction, and how many.

Before each request the context manager checks the projected KV (context + reserved generation)
against the budget's high watermark; past it, the oldest unpinned turns leave, one turn at a
time, until the context with the new summary in place of them fits under the low watermark.
The two watermarks keep compactions rare: between them every prompt extends the previous one,
and the prefix cache serves it whole.

What never leaves: the system prompt, pinned turns, and the turn being answered. Recall notes of
answered turns leave at every compaction (see :func:`served_notes`). Everything here reads the
session's messages and decides; nothing is written (the context manager records, then applies).
"""

from collections.abc import Sequence

from memory.budget import Budget
from memory.records import MessageRecord


def current_turn(messages: Sequence[MessageRecord]) -> int:
    return max((m.turn for m in messages), default=0)


def pending_turn(messages: Sequence[MessageRecord]) -> int | None:
    """The turn being answered (its user message is the last user message and unanswered)."""
    chat = [m for m in messages if m.kind == "chat"]
    if not chat:
        return None
    last_user = max((m.turn for m in chat if m.role == "user"), default=None)
    if last_user is None:
        return None
    answered = any(m.turn == last_user and m.role == "assistant" for m in chat)
    last = chat[-1]
    if answered and last.role == "assistant":
        return None
    return last_user


def answering_turn(messages: Sequence[MessageRecord]) -> int:
    """The turn being answered, or the next one when every turn has its reply."""
    return pending_turn(messages) or current_turn(messages) + 1


def evictable(messages: Sequence[MessageRecord]) -> list[MessageRecord]:
    return [m for m in messages if m.state == "live" and not m.pinned]


def unevictable_tokens(messages: Sequence[MessageRecord], pending: int) -> int:
    """Tokens of the live messages no compaction removes: pinned ones and those of ``pending``."""
    return sum(m.token_count for m in messages if m.state == "live" and (m.pinned or m.turn == pending))


def served_notes(messages: Sequence[MessageRecord]) -> list[MessageRecord]:
    """Recall notes of answered turns: they leave at every compaction, whichever turns go.

    A note is there for the reply to its question; once that reply exists, the note is a
    verbatim copy of stored text taking budget from live turns (a conversation that recalls
    often would otherwise keep fewer turns live than one that does not). Dropping it at a
    compaction costs no prefix-cache hits, since everything after the summary is re-read
    then anyway, and the next question that needs it recalls it again.
    """
    answering = answering_turn(messages)
    return [m for m in evictable(messages) if m.kind == "recall" and m.turn < answering]


def compactable_turns(messages: Sequence[MessageRecord]) -> list[int]:
    """Every completed turn with an unpinned live message (what a manual ``/compact`` folds)."""
    keep_from = pending_turn(messages)
    return sorted({m.turn for m in evictable(messages) if keep_from is None or m.turn < keep_from})


def auto_compact_turns(
    messages: Sequence[MessageRecord],
    budget: Budget,
    context_tokens: int,
    generation_tokens: int,
    old_summary_tokens: int,
    max_summary_tokens: int,
) -> list[int]:
    """The oldest turns whose leaving brings the prompt under the low watermark (or all that may).

    ``context_tokens`` is the prompt as it stands, ``generation_tokens`` the generation prompt's,
    ``old_summary_tokens`` the current summary's (0 without one) and ``max_summary_tokens`` the
    most the summarizer is asked to write.
    """
    candidates = evictable(messages)
    keep_from = answering_turn(messages)
    turns = sorted({m.turn for m in candidates if m.turn < keep_from})
    if not turns:
        return []
    target = budget.low_tokens - budget.reserve_tokens - generation_tokens
    summary_cap = int(budget.tokens * budget.summary_share)
    # The new summary is expected to be about as long as the one it replaces (the model is
    # asked for the same length each time); the first one may take all it is allowed. Taking
    # the allowance every time evicted a few turns too many whenever summaries came out short.
    longest = min(max_summary_tokens, summary_cap) + 8
    expected_summary = min(longest, max(old_summary_tokens + 32, 64)) if old_summary_tokens else longest
    served = sum(m.token_count for m in served_notes(messages))
    chosen: list[int] = []
    for turn in turns:
        chosen.append(turn)
        freed = served + sum(m.token_count for m in candidates if m.turn in chosen and m.kind == "chat")
        if context_tokens - freed - old_summary_tokens + expected_summary <= target:
            break
    return chosen


def leaving(messages: Sequence[MessageRecord], turns: Sequence[int]) -> list[MessageRecord]:
    """The messages a compaction of ``turns`` takes out: their unpinned ones, and served notes."""
    turn_set = set(turns)
    served = {m.id for m in served_notes(messages)}
    return [m for m in evictable(messages) if m.turn in turn_set or m.id in served]


def window_start_after(
    messages: Sequence[MessageRecord], gone: Sequence[MessageRecord], last_turn: int, window_start: int
) -> int:
    """Where the recent section starts once ``gone`` has left in a compaction up to ``last_turn``.

    It starts at the first live message after the compacted turns; pinned turns up to the last
    compacted one (pinned turns are never compacted, so they may sit between compacted ones)
    move in front of the summary, into the pinned section.
    """
    remaining = [m for m in messages if m.state == "live" and m not in gone]
    return min(
        (m.seq for m in remaining if m.seq >= window_start and not (m.pinned and m.turn <= last_turn)),
        default=max((m.seq for m in messages), default=0) + 1,
    )
