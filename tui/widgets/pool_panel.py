"""The engine's KV pool and prefix cache: blocks used / cached / free, and how often prompts hit.

With a disk tier, one more line: its blocks and bytes against its limit, and the tokens it served
(or why it turned itself off).

Blocks come from ``backend.stats()`` (polled while a reply streams); a remote backend has none,
so they show "n/a". Prefix-cache hits come from the session's own requests (the engine's, or the
cached-token count a remote server reports): the last request's, and all of this session's.
"""

from dataclasses import dataclass

from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from runtime.engine.metrics import EngineStats
from runtime.sizes import format_bytes
from tui.widgets.bar import segments


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """Prompt tokens served by the prefix cache, for the last request and the session so far."""

    last_cached: int = 0
    last_prompt: int = 0
    total_cached: int = 0
    total_prompt: int = 0

    def add(self, cached: int, prompt: int) -> "PrefixHits":
        return PrefixHits(cached, prompt, self.total_cached + cached, self.total_prompt + prompt)

    @property
    def last_rate(self) -> float | None:
        return self.last_cached / self.last_prompt if self.last_prompt else None

    @property
    def overall_rate(self) -> float | None:
        return self.total_cached / self.total_prompt if self.total_prompt else None


class PoolPanel(Widget):
    DEFAULT_CSS = """
    PoolPanel {
        height: auto;
        border: round $secondary 60%;
        border-title-color: $secondary;
        padding: 0 1;
    }
    """

    stats: reactive[EngineStats | None] = reactive(None, layout=True)
    hits: reactive[PrefixHits] = reactive(PrefixHits, layout=True)

    def on_mount(self) -> None:
        self.border_title = "KV pool · prefix cache"

    def render(self) -> Content:
        s, h = self.stats, self.hits
        width = max(10, self.content_region.width or 30)
        if s is None:
            pool: list[Content | str] = ["blocks n/a (no engine stats from this backend)"]
        else:
            pool = [
                Content.assemble(
                    (f"{s.num_blocks_used:,}", "bold $accent"),
                    " used · ",
                    (f"{s.num_blocks_cached:,}", "bold $primary"),
                    " cached · ",
                    (f"{s.num_blocks_free:,}", "bold"),
                    f" free / {s.num_blocks_total:,} × {s.block_size}",
                ),
                segments(
                    [(s.num_blocks_used, "$accent"), (s.num_blocks_cached, "$primary")],
                    s.num_blocks_total,
                    width,
                ),
            ]
        if s is not None and s.kv_disk_limit_bytes:
            pool.append(_disk_line(s))
        last = _rate(h.last_rate, h.last_cached, h.last_prompt)
        overall = _rate(h.overall_rate, h.total_cached, h.total_prompt)
        return Content("\n").join([*pool, f"hit last {last}", f"hit all  {overall}"])


def _disk_line(s: EngineStats) -> str:
    if s.kv_disk_notice:
        return "disk off (unwritable)"
    size = f"{format_bytes(s.kv_disk_bytes)}/{format_bytes(s.kv_disk_limit_bytes)}"
    return f"disk {s.kv_disk_blocks:,} blocks · {size} · hit {s.kv_disk_hit_tokens:,} tok"


def _rate(rate: float | None, cached: int, prompt: int) -> str:
    return "n/a" if rate is None else f"{rate:.0%} ({cached:,}/{prompt:,} tok)"
