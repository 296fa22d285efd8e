"""The layout of the prompt: which live message goes where, and what each section costs.

::

    [system] [pinned] [summary] [recent turns ... [recalled] [new message]]

``pinned`` holds the pinned messages that outlived their turns' compaction (those before the
session's ``window_start``), ``summary`` the model-written summary of everything compacted so far,
and each turn's recall note sits directly before the user message it was recalled for (see
``memory/recall.py`` for why). The front stays fixed between compactions, so every prompt is the
previous prompt plus the reply plus the new turn, token for token, and the engine's prefix cache
serves all of the history.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from memory.chat_render import Renderer
from memory.compaction import CompactionEvent
from memory.records import MessageRecord, SearchHit
from runtime.backends.backend import ChatPrompt

SECTIONS = ("system", "pinned", "summary", "recalled", "recent", "new")
SUMMARY_HEADER = "Summary of the earlier conversation:\n"


@dataclass(slots=True)
class BuiltPrompt:
    """The next request's prompt, with the tokens each section of the layout takes."""

    token_ids: list[int]
    messages: list[dict[str, str]]
    sections: dict[str, int]
    max_tokens: int  # the most the reply may generate without passing the budget
    budget_tokens: int
    recalled: list[SearchHit] = field(default_factory=list)
    compactions: list[CompactionEvent] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chat_prompt(self) -> ChatPrompt:
        return ChatPrompt(self.messages, self.token_ids)


def summary_tokens(renderer: Renderer, summary: str) -> int:
    """Tokens the summary takes in the prompt, its header included."""
    return renderer.count("system", SUMMARY_HEADER + summary)


def layout(
    renderer: Renderer,
    system: str,
    summary: str | None,
    messages: Sequence[MessageRecord],
    window_start: int,
    pending: int | None,
) -> tuple[list[MessageRecord], dict[str, int]]:
    """The live ``messages`` in prompt order, and the tokens of each section.

    ``pending`` is the turn being answered: its recall note and its messages are the
    ``recalled`` and ``new`` sections.
    """
    sections = dict.fromkeys(SECTIONS, 0)
    sections["system"] = renderer.count("system", system, first=True)
    if summary is not None:
        sections["summary"] = summary_tokens(renderer, summary)
    front = [m for m in messages if m.state == "live" and m.seq < window_start]
    recent = [m for m in messages if m.state == "live" and m.seq >= window_start]
    # Within a turn a recall note goes before the user message it was made for.
    recent.sort(key=lambda m: (m.turn, m.kind != "recall", m.seq))
    for m in front:
        sections["pinned"] += m.token_count
    for m in recent:
        if m.turn == pending and m.kind == "recall":
            sections["recalled"] += m.token_count
        elif m.turn == pending:
            sections["new"] += m.token_count
        else:
            sections["recent"] += m.token_count
    return front + recent, sections


def render(
    renderer: Renderer, system: str, summary: str | None, ordered: Sequence[MessageRecord], window_start: int
) -> tuple[list[dict[str, str]], list[int]]:
    """The chat messages and token ids of the messages ``layout`` ordered, the summary placed
    between the pinned section and the recent turns (without a generation prompt)."""
    messages = [{"role": "system", "content": system}]
    ids = list(renderer.message_ids("system", system, first=True))
    summary_done = summary is None
    for m in ordered:
        if not summary_done and m.seq >= window_start:
            summary_done = _render_summary(renderer, summary, messages, ids)
        messages.append({"role": m.role, "content": m.content})
        ids += renderer.message_ids(m.role, m.content)
    if not summary_done:
        _render_summary(renderer, summary, messages, ids)
    return messages, ids


def _render_summary(
    renderer: Renderer, summary: str | None, messages: list[dict[str, str]], ids: list[int]
) -> bool:
    assert summary is not None
    content = SUMMARY_HEADER + summary
    messages.append({"role": "system", "content": content})
    ids += renderer.message_ids("system", content)
    return True
