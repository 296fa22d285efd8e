"""``/stats``: this session's totals, its context, and the engine's pool and prefix cache."""

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from memory.store import Store
from runtime.engine.metrics import EngineStats
from runtime.sizes import format_bytes
from tui.messages import ContextSnapshot
from tui.totals import SessionTotals


def session_slope_text(db_path: Path, session_id: str) -> str | None:
    """The session's cost slope (``liubai logs slope``) as text, or None before it can be fitted.

    Read through a connection of its own: the agent's worker may be writing on the session's.
    """
    from agent.logs.slope import render_slope, session_slope

    store = Store(db_path)
    try:
        report = session_slope(store, session_id)
        return render_slope(report) if report is not None else None
    finally:
        store.close()


def stats_markdown(
    session_id: str,
    model: str,
    context: ContextSnapshot,
    totals: SessionTotals,
    engine: EngineStats | None,
    slope: str | None = None,
) -> str:
    states = {s: sum(t.state == s for t in context.turns) for s in ("live", "summarized", "evicted")}
    hit = f"{totals.cached_tokens / totals.prompt_tokens:.0%}" if totals.prompt_tokens else "n/a"
    usd = f"${totals.usd:.6f}" if totals.usd is not None else "n/a"
    rows = [
        ("session", f"`{session_id}`"),
        ("model", model),
        ("turns", f"{len(context.turns)} ({states['live']} live, {states['summarized']} summarized, "
                  f"{states['evicted']} evicted)"),
        ("context", f"{context.context_tokens:,} of {context.budget_tokens:,} tok ({context.budget_text})"),
        ("requests", f"{totals.num_requests} ({totals.num_summary_requests} summaries)"),
        ("prompt tokens", f"{totals.prompt_tokens:,} ({totals.cached_tokens:,} prefix-cache hits, {hit})"),
        ("prefilled tokens", f"{totals.prefilled_tokens:,}"),
        ("generated tokens", f"{totals.generated_tokens:,}"),
        ("compute", f"{totals.compute_s:.2f} s"),
        ("cost", usd),
    ]  # fmt: skip
    if engine is None:
        rows.append(("engine", "n/a (no engine stats from this backend)"))
    else:
        rate = f"{engine.prefix_hit_rate:.0%}" if engine.prefix_queried_tokens else "n/a"
        rows += [
            ("KV pool", f"{format_bytes(engine.kv_pool_bytes)}: {engine.num_blocks_total:,} blocks of "
                        f"{engine.block_size} tokens, K {engine.k_dtype} / V {engine.v_dtype}"),
            ("blocks", f"{engine.num_blocks_used:,} used · {engine.num_blocks_cached:,} cached · "
                       f"{engine.num_blocks_free:,} free"),
            ("engine prefix cache", f"{engine.prefix_hit_tokens:,} of {engine.prefix_queried_tokens:,} "
                                    f"queried tokens hit ({rate})"),
            ("preemptions", f"{engine.num_preemptions}"),
        ]  # fmt: skip
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    if slope is None:
        growth = "Not enough turns yet to fit how latency and cost grow with context (needs 3)."
    else:
        growth = f"```\n{slope}\n```"
    return f"# Session stats\n\n| | |\n|---|---|\n{table}\n\n## Cost slope\n\n{growth}\n"


class StatsScreen(ModalScreen[None]):
    CSS_PATH = "stats.tcss"
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("q", "dismiss", "Close", show=False)]

    def __init__(self, markdown: str) -> None:
        super().__init__()
        self.markdown = markdown

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="stats-dialog"):
            yield Markdown(self.markdown)
