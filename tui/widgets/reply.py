"""The model's reply: Markdown that grows as tokens stream in.

Appends go through Textual's ``MarkdownStream``, which batches fragments when they arrive faster
than the Markdown can be re-rendered, so a fast decode never backs up the UI.
"""

from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream


class AssistantReply(Markdown):
    DEFAULT_CSS = """
    AssistantReply {
        border: round $success 50%;
        border-title-color: $success;
        padding: 0 1;
        margin: 1 0 0 0;
        &.-left { opacity: 70%; border: round $success 25%; }
        &.-interrupted { border: round $warning 60%; }
    }
    """

    def __init__(self, turn: int, text: str = "", state: str = "live", interrupted: bool = False) -> None:
        super().__init__(text)
        self.turn = turn
        self._stream: MarkdownStream | None = None
        self._received = text
        self._state = state
        self._interrupted = interrupted
        self.border_title = f"liubai · turn {turn}"
        self._mark()

    @property
    def text(self) -> str:
        """Everything received so far (including fragments the stream has not rendered yet)."""
        return self._received

    async def write(self, fragment: str) -> None:
        self._received += fragment
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        await self._stream.write(fragment)

    async def finish(self, interrupted: bool = False) -> None:
        """Render whatever is still pending and stop streaming."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self._interrupted = interrupted
        self._mark()

    def set_state(self, state: str) -> None:
        """live, or summarized / evicted: out of the live context (dimmed, and said so)."""
        self._state = state
        self._mark()

    def _mark(self) -> None:
        notes = [self._state] if self._state != "live" else []
        if self._interrupted:
            notes.append("interrupted")
        self.border_subtitle = " · ".join(notes)
        self.set_class(self._state != "live", "-left")
        self.set_class(self._interrupted, "-interrupted")
