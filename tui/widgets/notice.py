"""A line in the chat that is not a message: a compaction, a cleared context, a resumed session."""

from textual.content import Content
from textual.widgets import Static


class Notice(Static):
    DEFAULT_CSS = """
    Notice {
        color: $text-muted;
        text-style: italic;
        padding: 0 1;
        margin: 1 0 0 0;
        &.-compaction { color: $warning; }
    }
    """

    def __init__(self, text: str, kind: str = "info") -> None:
        super().__init__(Content(text), classes=f"-{kind}")
        self.text = text
        self.kind = kind
