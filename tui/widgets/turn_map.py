"""The turn map: every user turn of the session, what became of it, and what it costs in tokens.

A turn is live (in the prompt), summarized (folded into the running summary) or evicted (only in
the store, recallable); pinned turns stay live through compactions.
"""

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import DataTable, Static

from memory.context_manager import TurnInfo

STATE_STYLES = {"live": "green", "summarized": "yellow", "evicted": "red"}  # Rich styles: DataTable cells


class TurnMap(Widget):
    DEFAULT_CSS = """
    TurnMap {
        height: auto;
        max-height: 50%;
        border: round $secondary 60%;
        border-title-color: $secondary;
        padding: 0 1;
        & > DataTable { height: auto; max-height: 16; background: transparent; }
        & > .summary { color: $text-muted; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.turns: tuple[TurnInfo, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static("no turns yet", classes="summary")
        table: DataTable[Text] = DataTable(cursor_type="none", zebra_stripes=False, show_cursor=False)
        table.can_focus = False
        yield table

    def on_mount(self) -> None:
        self.border_title = "turns"
        self.query_one(DataTable).add_columns("#", "state", "pin", "tok", "preview")

    def state_of(self, turn: int) -> TurnInfo | None:
        return next((t for t in self.turns if t.turn == turn), None)

    def show(self, turns: Sequence[TurnInfo]) -> None:
        self.turns = tuple(turns)
        table = self.query_one(DataTable)
        table.clear()
        for t in reversed(self.turns):  # newest first: the live end of the conversation on top
            table.add_row(
                Text(str(t.turn), justify="right"),
                Text(t.state, style=STATE_STYLES.get(t.state, "")),
                Text("●" if t.pinned else ""),
                Text(f"{t.tokens:,}", justify="right"),
                Text(t.preview[:24], style="dim"),
                key=str(t.turn),
            )
        counts = {state: sum(t.state == state for t in self.turns) for state in STATE_STYLES}
        pinned = sum(t.pinned for t in self.turns)
        parts = [f"{n} {state}" for state, n in counts.items() if n]
        if pinned:
            parts.append(f"{pinned} pinned")
        self.query_one(".summary", Static).update(" · ".join(parts) if parts else "no turns yet")
