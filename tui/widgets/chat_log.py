"""The conversation: user messages, streamed replies, collapsed tool calls and inline notices.

The log only mounts and updates its children; the chat screen decides when (from the agent's
messages). A turn's reply is streamed into the newest :class:`AssistantReply`; a tool call closes
it, and the next round's text starts a new one below the call, so the log reads in the order
things happened.
"""

import json
from collections.abc import Iterable

from textual.containers import VerticalScroll
from textual.widget import Widget

from memory.store import MessageRecord
from tui.widgets.notice import Notice
from tui.widgets.reply import AssistantReply
from tui.widgets.tool_call import ToolCallView
from tui.widgets.user_message import UserMessage

TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class ChatLog(VerticalScroll):
    DEFAULT_CSS = """
    ChatLog {
        height: 1fr;
        padding: 0 1 1 1;
        scrollbar-size-vertical: 1;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._reply: AssistantReply | None = None

    # -- what the tests and the screen read ---------------------------------------------------

    @property
    def replies(self) -> list[AssistantReply]:
        return list(self.query_children(AssistantReply))

    @property
    def notices(self) -> list[Notice]:
        return list(self.query_children(Notice))

    @property
    def tool_calls(self) -> list[ToolCallView]:
        return list(self.query_children(ToolCallView))

    @property
    def user_messages(self) -> list[UserMessage]:
        return list(self.query_children(UserMessage))

    @property
    def streaming(self) -> bool:
        return self._reply is not None

    # -- building it --------------------------------------------------------------------------

    async def add_user(self, text: str, turn: int) -> None:
        await self._add(UserMessage(text, turn))

    async def add_notice(self, text: str, kind: str = "info") -> None:
        await self._add(Notice(text, kind))

    async def write_reply(self, turn: int, fragment: str) -> None:
        if self._reply is None:
            self._reply = AssistantReply(turn)
            await self._add(self._reply)
        follow = self._at_bottom()
        await self._reply.write(fragment)
        if follow:
            self.call_after_refresh(self.scroll_end, animate=False)

    async def end_reply(self, turn: int, answer: str, interrupted: bool) -> None:
        """Close the turn's reply; a turn that streamed nothing still shows its answer (or "no reply")."""
        if self._reply is None and (answer or interrupted or not self._turn_has_reply(turn)):
            self._reply = AssistantReply(turn, answer or ("*(no reply)*" if not interrupted else ""))
            await self._add(self._reply)
        if self._reply is not None:
            await self._reply.finish(interrupted)
            self._reply = None

    async def add_tool_call(self, name: str, arguments: dict[str, object]) -> None:
        await self._close_reply()
        await self._add(ToolCallView(name, arguments))

    async def finish_tool_call(
        self, name: str, ok: bool, refused: bool, truncated: bool, content: str
    ) -> None:
        """Show a call's result in its view (a malformed call, never announced, gets a view of its own)."""
        pending = [v for v in self.tool_calls if v.tool_name == name and v.result is None]
        if pending:
            view = pending[0]
        else:
            await self._close_reply()
            view = ToolCallView(name)
            await self._add(view)
        view.finish(ok, refused, truncated, content)

    def mark_states(self, states: dict[int, str]) -> None:
        """Mark each turn's messages with its state (after a compaction, a /clear or a /pin)."""
        for widget in self.children:
            if isinstance(widget, UserMessage | AssistantReply) and widget.turn in states:
                widget.set_state(states[widget.turn])

    async def show_history(self, messages: Iterable[MessageRecord]) -> None:
        """A resumed session's stored conversation, each message marked with its state."""
        widgets: list[Widget] = []
        for m in messages:
            if m.kind != "chat" or m.turn == 0:
                continue  # the system prompt, recall notes
            if m.role == "user":
                widgets.append(UserMessage(m.content, m.turn, m.state))
            elif m.role == "assistant":
                widgets.append(AssistantReply(m.turn, m.content, m.state, m.interrupted))
            elif m.role == "tool":
                widgets.append(_stored_tool_call(m.content))
        if widgets:
            await self.mount_all(widgets)
            self.call_after_refresh(self.scroll_end, animate=False)

    async def _add(self, widget: Widget) -> None:
        """Mount at the end, following it down if the view was at the bottom (not if scrolled up)."""
        follow = self._at_bottom()
        await self.mount(widget)
        if follow:
            self.call_after_refresh(self.scroll_end, animate=False)

    def _at_bottom(self) -> bool:
        return self.scroll_y >= self.max_scroll_y - 1

    async def _close_reply(self) -> None:
        if self._reply is not None:
            await self._reply.finish()
            self._reply = None

    def _turn_has_reply(self, turn: int) -> bool:
        return any(r.turn == turn for r in self.replies)


def _stored_tool_call(content: str) -> ToolCallView:
    """A stored ``<tool_response>`` message as a collapsed view (name and result, if it parses)."""
    body = content.strip().removeprefix(TOOL_RESPONSE_OPEN).removesuffix(TOOL_RESPONSE_CLOSE).strip()
    try:
        payload = json.loads(body)
        name, result = str(payload["name"]), str(payload["content"])
    except (ValueError, KeyError, TypeError):
        name, result = "tool", body
    view = ToolCallView(name)
    view.finish(True, False, False, result)
    return view
