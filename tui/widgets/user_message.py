"""A message the user sent, as the chat log shows it."""

from textual.content import Content
from textual.widgets import Static


class UserMessage(Static):
    DEFAULT_CSS = """
    UserMessage {
        border: round $primary 60%;
        border-title-color: $primary;
        padding: 0 1;
        margin: 1 0 0 0;
        &.-left { opacity: 70%; border: round $primary 30%; }
    }
    """

    def __init__(self, text: str, turn: int, state: str = "live") -> None:
        super().__init__(Content(text))
        self.text = text
        self.turn = turn
        self.border_title = f"you · turn {turn}"
        self.set_state(state)

    def set_state(self, state: str) -> None:
        """live, or summarized / evicted: out of the live context (dimmed, and said so)."""
        self.border_subtitle = "" if state == "live" else state
        self.set_class(state != "live", "-left")
