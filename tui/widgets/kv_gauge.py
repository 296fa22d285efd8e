"""KV in use against the session's budget: tokens, bytes and a bar, with the storage dtypes.

While a reply streams the figure is the prompt plus the tokens generated so far, so the bar
moves with the text; when a request ends it is the count the engine reported. Between turns
(after ``/clear``, ``/compact``, ``/budget``) it is the context as it stands. A remote backend
cannot tell its bytes per token, so bytes show as "n/a" and the budget is in tokens alone.
"""

from dataclasses import dataclass

from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from runtime.sizes import format_bytes
from tui.widgets.bar import bar


@dataclass(frozen=True, slots=True)
class KVReading:
    tokens: int
    budget_tokens: int
    bytes_per_token: int | None
    k_dtype: str | None
    v_dtype: str | None
    source: str  # "streaming", "last request" (the count a request reported) or "context" (between turns)
    high_watermark: float = 0.85

    @property
    def num_bytes(self) -> int | None:
        return self.tokens * self.bytes_per_token if self.bytes_per_token else None

    @property
    def budget_bytes(self) -> int | None:
        return self.budget_tokens * self.bytes_per_token if self.bytes_per_token else None

    @property
    def fraction(self) -> float:
        return self.tokens / self.budget_tokens if self.budget_tokens else 0.0


class KVGauge(Widget):
    DEFAULT_CSS = """
    KVGauge {
        height: auto;
        border: round $secondary 60%;
        border-title-color: $secondary;
        padding: 0 1;
    }
    """

    reading: reactive[KVReading | None] = reactive(None, layout=True)

    def on_mount(self) -> None:
        self.border_title = "KV budget"

    def watch_reading(self, reading: KVReading | None) -> None:
        self.border_subtitle = reading.source if reading is not None else ""

    def render(self) -> Content:
        r = self.reading
        if r is None:
            return Content("waiting for the first request…")
        width = max(10, self.content_region.width or 30)
        used, budget = r.num_bytes, r.budget_bytes
        bytes_line = (
            f"{format_bytes(used)} / {format_bytes(budget)}" if used is not None and budget else "bytes n/a"
        )
        per_token = f"{r.bytes_per_token:,} B/tok" if r.bytes_per_token else "B/tok n/a"
        style = "$error" if r.fraction >= 1 else "$warning" if r.fraction >= r.high_watermark else "$success"
        return Content.assemble(
            (f"{r.tokens:,}", "bold"),
            f" / {r.budget_tokens:,} tok  ",
            (f"{r.fraction:.0%}", style),
            "\n",
            bytes_line,
            "\n",
            bar(r.fraction, width, style),
            "\n",
            (f"K {r.k_dtype or 'n/a'} · V {r.v_dtype or 'n/a'} · {per_token}", "dim"),
        )
