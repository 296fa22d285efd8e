"""One tool call in the chat: collapsed to its name, arguments and outcome; its result inside."""

import json
from typing import Any

from textual.content import Content
from textual.widgets import Collapsible, Static

MAX_ARGUMENTS_CHARS = 60


class ToolCallView(Collapsible):
    DEFAULT_CSS = """
    ToolCallView {
        margin: 1 0 0 0;
        border-top: none;
        padding-bottom: 0;
        background: $boost;
        & > Contents { padding: 0 1; height: auto; max-height: 16; overflow-y: auto; }
        &.-failed CollapsibleTitle { color: $error; }
    }
    """

    def __init__(self, name: str, arguments: dict[str, Any] | None = None) -> None:
        self.tool_name = name
        self.arguments = dict(arguments or {})
        self.result: str | None = None
        self.ok: bool | None = None
        self._result_view = Static(Content("running…"), classes="tool-result")
        super().__init__(self._result_view, title=self._heading(), collapsed=True)

    def finish(self, ok: bool, refused: bool, truncated: bool, content: str) -> None:
        self.ok = ok
        self.result = content
        outcome = "✓" if ok else ("refused" if refused else "✗ failed")
        self.title = f"{self._heading()} {outcome}{' (truncated)' if truncated else ''}"
        self.set_class(not ok, "-failed")
        self._result_view.update(Content(content or "(no output)"))

    def _heading(self) -> str:
        arguments = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in self.arguments.items())
        if len(arguments) > MAX_ARGUMENTS_CHARS:
            arguments = arguments[: MAX_ARGUMENTS_CHARS - 1] + "…"
        return f"tool {self.tool_name}({arguments})"
