"""Latency of the session's turns: the last TTFT, prefill and decode speed, with sparklines.

Each point is one turn's first request (the one that answers the user), as the engine measured
it; a resumed session starts with the points its stored requests recorded. When the last turn's
request verified guesses (speculative decoding), the decode row also says how many tokens a step
accepted on average; without speculation the row is as it always was. The panel's subtitle says
how the engine runs now: its weight format and whether decode steps go through compiled graphs
("int4 · compiled"; a step that fell back to eager says so after its turn); a remote backend,
which does not say, leaves it empty.
"""

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import Label, Sparkline

MAX_POINTS = 64


@dataclass(frozen=True, slots=True)
class LatencySample:
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    mean_accepted_length: float = 0.0  # RequestMetrics.mean_accepted_length; 0: no guesses verified


SERIES = (
    ("ttft", "TTFT", lambda s: s.ttft_ms, lambda v: f"{v:,.0f} ms"),
    ("prefill", "prefill", lambda s: s.prefill_tok_s, lambda v: f"{v:,.0f} tok/s"),
    ("decode", "decode", lambda s: s.decode_tok_s, lambda v: f"{v:,.1f} tok/s"),
)


class LatencyPanel(Widget):
    DEFAULT_CSS = """
    LatencyPanel {
        height: auto;
        border: round $secondary 60%;
        border-title-color: $secondary;
        padding: 0 1;
        & > Horizontal { height: 1; }
        & .name { width: 8; color: $text-muted; }
        & .value { width: 12; text-align: right; margin-right: 1; }
        & #accepted { display: none; width: auto; margin-right: 1; color: $text-muted; }
        & Sparkline { width: 1fr; height: 1; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.samples: list[LatencySample] = []

    def compose(self) -> ComposeResult:
        for key, name, _, _ in SERIES:
            with Horizontal(id=f"row-{key}"):
                yield Label(name, classes="name")
                yield Label("n/a", id=f"value-{key}", classes="value")
                if key == "decode":
                    yield Label("", id="accepted")
                yield Sparkline([], id=f"spark-{key}")

    def on_mount(self) -> None:
        self.border_title = "latency"

    def show_engine(self, weights: str | None, compiled: bool | None) -> None:
        """The engine's weight format and compiled step, as its backend reports them (None: unknown)."""
        if not weights:
            self.border_subtitle = ""
        elif compiled is None:
            self.border_subtitle = weights
        else:
            self.border_subtitle = f"{weights} · {'compiled' if compiled else 'eager'}"

    @property
    def last(self) -> LatencySample | None:
        return self.samples[-1] if self.samples else None

    def add(self, *samples: LatencySample) -> None:
        self.samples = [*self.samples, *samples][-MAX_POINTS:]
        last = self.samples[-1] if self.samples else None
        for key, _, value_of, fmt in SERIES:
            value = value_of(last) if last is not None else 0.0
            self.query_one(f"#value-{key}", Label).update(fmt(value) if value else "n/a")
            self.query_one(f"#spark-{key}", Sparkline).data = [value_of(s) for s in self.samples]
        accepted = self.query_one("#accepted", Label)
        accepted.display = last is not None and last.mean_accepted_length > 0
        if last is not None and accepted.display:
            accepted.update(f"· accepted {last.mean_accepted_length:.1f}")
