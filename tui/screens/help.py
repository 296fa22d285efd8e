"""``/help`` (and F1): the commands and keys, over the chat."""

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from tui.commands import COMMAND_SPECS

KEYS = (
    ("Enter", "send the message (or run the /command)"),
    ("Ctrl-C", "cancel the reply; when idle, press twice to quit"),
    ("Ctrl-Q", "quit (a streaming reply is cancelled and stored first)"),
    ("Ctrl-P", "command palette: every /command, e.g. type `pin 2`"),
    ("F1", "this help"),
    ("Esc", "close this help"),
)


def help_markdown() -> str:
    commands = "\n".join(f"- `{spec.usage}` — {spec.help}" for spec in COMMAND_SPECS)
    keys = "\n".join(f"- **{key}** — {what}" for key, what in KEYS)
    return (
        "# liubai\n\n"
        "One message is answered at a time: while a reply streams, Enter is refused (your text stays "
        "in the input); `/help` and `/stats` still work.\n\n"
        f"## Commands\n\n{commands}\n\n## Keys\n\n{keys}\n"
    )


class HelpScreen(ModalScreen[None]):
    CSS_PATH = "help.tcss"
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("f1", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-dialog"):
            yield Markdown(help_markdown())
