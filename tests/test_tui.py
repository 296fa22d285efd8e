"""The chat app, driven by Textual's pilot: what it shows and what its commands change.

The main flows run the real default model through one module-scoped engine (a turn of 16 tokens
takes a second or two here); the checks that need no model (the palette, quitting, parsing,
the remote backend's "n/a") use the scripted backend of ``tests/test_tui_snapshots.py``. Each
test asserts state: the context manager, the store, and the widgets' own values.
"""

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Label

from agent.config import AgentConfig
from agent.session import AgentSession
from memory.store import Store
from runtime.backends.backend import LocalBackend
from tests.test_tui_snapshots import REPLIES, TOOL_CALL, ReplayBackend
from tui.app import LiubaiApp, run_chat
from tui.commands import CommandError, SlashCommand, parse_command
from tui.screens.help import HelpScreen
from tui.screens.stats import StatsScreen
from tui.widgets.chat_log import ChatLog
from tui.widgets.kv_gauge import KVGauge
from tui.widgets.latency_panel import LatencyPanel
from tui.widgets.pool_panel import PoolPanel
from tui.widgets.turn_map import TurnMap

SIZE = (130, 40)
Scenario = Callable[[LiubaiApp, Pilot[None]], Awaitable[None]]


@pytest.fixture(scope="module")
def backend(default_model_path: Path) -> LocalBackend:
    from runtime import Engine

    # float32 named: the budget's tokens and bytes shown are that dtype's.
    return LocalBackend(Engine(model=str(default_model_path), kv_pool="128MiB", dtype="float32"))


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def open_session(backend: Any, tmp_path: Path, session_id: str | None = None, **options: Any) -> AgentSession:
    config = AgentConfig(**{"max_tokens": 16, "tools": False, "db": str(tmp_path / "t.db"), **options})
    return AgentSession.open(backend, Store(config.db), config, session_id)


def run_app(session: AgentSession, scenario: Scenario) -> LiubaiApp:
    """Run ``scenario`` against the app (in its own event loop); return the app after it exits."""
    app = LiubaiApp(session)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await scenario(app, pilot)

    asyncio.run(main())
    return app


async def wait_until(pilot: Pilot[None], condition: Callable[[], bool], timeout: float = 90.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for the app")


async def send(app: LiubaiApp, pilot: Pilot[None], text: str, timeout: float = 90.0) -> None:
    """Put ``text`` in the input, press Enter, and wait until no job runs (and its last message is
    handled). The text is set rather than typed: the pilot spends ~50 ms on every key it presses.
    """
    app.chat.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await wait_until(pilot, lambda: app.chat.busy is None, timeout)
    await pilot.pause()


def notifications(app: LiubaiApp) -> list[str]:
    return [n.message for n in app._notifications]


# -- with the real model ------------------------------------------------------------------------


@pytest.mark.model
def test_reply_streams_into_the_chat_and_the_gauge_shows_the_engine_count(
    backend: LocalBackend, tmp_path: Path
) -> None:
    session = open_session(backend, tmp_path)
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "Hello! What is the capital of France?")
        seen["reply"] = app.chat.query_one(ChatLog).replies[-1].text
        seen["users"] = [m.text for m in app.chat.query_one(ChatLog).user_messages]
        seen["reading"] = app.chat.query_one(KVGauge).reading
        seen["gauge"] = str(app.chat.query_one(KVGauge).render())
        seen["pool"] = app.chat.query_one(PoolPanel).stats
        seen["turns"] = app.chat.query_one(TurnMap).turns
        seen["latency"] = app.chat.query_one(LatencyPanel).last

    run_app(session, scenario)
    answer = [m for m in session.context.messages() if m.role == "assistant"][-1].content
    request = session.store.requests(session.session_id)[-1]
    assert answer and seen["reply"] == answer
    assert seen["users"] == ["Hello! What is the capital of France?"]
    reading = seen["reading"]
    assert reading.source == "last request"
    assert reading.tokens == request["kv_tokens"] == request["prompt_tokens"] + request["generated_tokens"]
    assert reading.budget_tokens == session.context.budget.tokens
    assert reading.bytes_per_token == backend.bytes_per_token
    assert (reading.k_dtype, reading.v_dtype) == backend.kv_dtypes
    assert f"{reading.tokens:,} / {reading.budget_tokens:,} tok" in seen["gauge"]
    assert f"{backend.bytes_per_token:,} B/tok" in seen["gauge"]
    assert seen["pool"] is not None and seen["pool"].num_blocks_cached > 0
    assert [(t.turn, t.state) for t in seen["turns"]] == [(1, "live")]
    assert seen["latency"].ttft_ms == pytest.approx(request["ttft_ms"])


@pytest.mark.model
def test_keys_are_handled_while_the_model_generates(backend: LocalBackend, tmp_path: Path) -> None:
    """Typing, a refused Enter, F1 and the gauge all move while the worker streams; Ctrl-C cancels.

    (Each pilot key press waits up to ~2 s for the process to go idle, which it never does while
    the model runs, so the presses during the reply are few and the reply is long: 600 tokens,
    about 30 s here, cancelled after a few seconds.)
    """
    session = open_session(backend, tmp_path, max_tokens=600)
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        chat = app.chat.query_one(ChatLog)
        prompt = app.chat.query_one("#prompt", Input)
        prompt.value = "Write a long story about a dragon and a knight."
        await pilot.press("enter")
        await wait_until(pilot, lambda: bool(chat.replies) and len(chat.replies[-1].text.split()) >= 3)
        await pilot.press("x")
        seen["typed"] = (prompt.value, app.chat.busy)
        await pilot.press("enter")  # one turn at a time: refused, the text stays
        reading = app.chat.query_one(KVGauge).reading
        assert reading is not None
        seen["refused"] = (notifications(app), prompt.value, app.chat.busy)
        seen["streaming"] = (reading.source, reading.tokens, session.backend.stats())
        await pilot.press("f1")
        seen["help"] = (isinstance(app.screen, HelpScreen), app.chat.busy)
        await pilot.press("ctrl+c")  # the app's binding: it cancels over the help screen too
        await wait_until(pilot, lambda: app.chat.busy is None)
        await pilot.press("escape")
        seen["reply"] = chat.replies[-1]

    run_app(session, scenario)
    assert seen["typed"] == ("x", "turn")
    messages, value, busy = seen["refused"]
    assert any("one message at a time" in m for m in messages) and value == "x" and busy == "turn"
    source, tokens, stats = seen["streaming"]
    prompt_tokens = session.store.requests(session.session_id)[-1]["prompt_tokens"]
    assert source == "streaming" and tokens > prompt_tokens
    assert stats.num_running == 1 and stats.num_blocks_used > 0
    assert seen["help"] == (True, "turn")
    stored = [m for m in session.context.messages() if m.role == "assistant"][-1]
    assert stored.interrupted and seen["reply"].has_class("-interrupted")
    assert seen["reply"].text == stored.content
    assert session.store.requests(session.session_id)[-1]["generated_tokens"] < 600


@pytest.mark.model
def test_compaction_shows_in_the_chat_and_the_turn_map(backend: LocalBackend, tmp_path: Path) -> None:
    session = open_session(backend, tmp_path, kv_budget="160tok")
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        for i in range(4):
            await send(app, pilot, f"Tell me fact number {i + 1} about the ocean.", timeout=120)
        chat = app.chat.query_one(ChatLog)
        seen["notices"] = [n.text for n in chat.notices if n.kind == "compaction"]
        seen["map"] = [(t.turn, t.state) for t in app.chat.query_one(TurnMap).turns]
        seen["dimmed"] = sorted({m.turn for m in chat.user_messages if m.has_class("-left")})

    run_app(session, scenario)
    compactions = session.store.compactions(session.session_id)
    assert compactions, "a 160-token budget compacts within four turns"
    assert len(seen["notices"]) == len(compactions)
    assert seen["notices"][0].startswith("⟲ compacted turn")
    assert seen["map"] == [(t.turn, t.state) for t in session.context.turn_map()]
    left = [turn for turn, state in seen["map"] if state in ("summarized", "evicted")]
    assert left and seen["dimmed"] == left


@pytest.mark.model
def test_pin_budget_clear_and_export_commands(backend: LocalBackend, tmp_path: Path) -> None:
    session = open_session(backend, tmp_path)
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        turn_map, gauge = app.chat.query_one(TurnMap), app.chat.query_one(KVGauge)
        await send(app, pilot, "My name is Ada.")
        await send(app, pilot, "I live in Paris.")
        await send(app, pilot, "/pin 1")
        seen["pinned"] = [(t.turn, t.pinned) for t in turn_map.turns]
        await send(app, pilot, "/pin 7")
        seen["pin error"] = notifications(app)[-1]
        await send(app, pilot, "/budget 3000tok")
        assert gauge.reading is not None
        seen["budget"] = (session.context.budget.tokens, gauge.reading.budget_tokens, notifications(app)[-1])
        await send(app, pilot, "/budget 5tok")
        seen["budget error"] = (notifications(app)[-1], session.context.budget.tokens)
        await send(app, pilot, "/clear")
        assert gauge.reading is not None
        seen["cleared"] = (
            [(t.turn, t.state, t.pinned) for t in turn_map.turns],
            [n.text for n in app.chat.query_one(ChatLog).notices],
            gauge.reading.tokens,
            gauge.reading.source,
        )
        await send(app, pilot, f"/export {tmp_path / 'chat.jsonl'}")
        await send(app, pilot, f"/export {tmp_path / 'chat.md'}")
        await send(app, pilot, "/unpin 1")
        seen["unpinned"] = [(t.turn, t.pinned) for t in turn_map.turns]

    run_app(session, scenario)
    assert seen["pinned"] == [(1, True), (2, False)]
    assert "there is no turn 7" in seen["pin error"]
    # The 128 MiB pool holds 2,912 float32 tokens: a larger budget is capped there, and says so.
    assert seen["budget"][:2] == (2912, 2912)
    assert "2,912 tokens" in seen["budget"][2] and "3000tok would be 3,000" in seen["budget"][2]
    assert "5tok" in seen["budget error"][0] and seen["budget error"][1] == 2912
    turns, notices, tokens, source = seen["cleared"]
    assert turns == [(1, "live", True), (2, "evicted", False)]
    assert any(n.startswith("⟲ cleared turn 2") for n in notices)
    assert source == "context" and tokens == session.context.context_tokens()
    assert seen["unpinned"] == [(1, False), (2, False)]

    rows = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    stored = session.context.messages()
    assert [(r["turn"], r["role"], r["state"], r["content"]) for r in rows] == [
        (m.turn, m.role, m.state, m.content) for m in stored
    ]
    markdown = (tmp_path / "chat.md").read_text()
    assert "## Turn 2" in markdown and "**user** · evicted" in markdown and "My name is Ada." in markdown


@pytest.mark.model
def test_resume_shows_the_earlier_messages(backend: LocalBackend, tmp_path: Path) -> None:
    first = open_session(backend, tmp_path)
    result = first.run_turn("Remember the number 42.")
    resumed = open_session(backend, tmp_path, session_id=first.session_id)
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await pilot.pause()
        chat = app.chat.query_one(ChatLog)
        seen["chat"] = ([m.text for m in chat.user_messages], [r.text for r in chat.replies])
        seen["notices"] = [n.text for n in chat.notices]
        seen["turns"] = [t.turn for t in app.chat.query_one(TurnMap).turns]
        seen["latency"] = len(app.chat.query_one(LatencyPanel).samples)

    run_app(resumed, scenario)
    assert seen["chat"] == (["Remember the number 42."], [result.answer])
    assert any(n.startswith(f"resumed session {first.session_id}") for n in seen["notices"])
    assert seen["turns"] == [1] and seen["latency"] == 1


# -- with the scripted backend ------------------------------------------------------------------


def test_command_palette_runs_slash_commands(tokenizer: Any, tmp_path: Path) -> None:
    session = open_session(ReplayBackend(tokenizer, REPLIES), tmp_path, kv_budget="2000tok")

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await pilot.press("ctrl+p")
        await pilot.press(*"budget 4000tok")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: session.context.budget.tokens == 4000, timeout=5)
        await pilot.press("ctrl+p")
        await pilot.press(*"pin")
        await pilot.pause(0.3)
        await pilot.press("enter")  # /pin needs N: the input is prefilled instead
        prompt = app.chat.query_one("#prompt", Input)
        await wait_until(pilot, lambda: prompt.value == "/pin ", timeout=5)

    run_app(session, scenario)


def test_tool_calls_are_collapsed_with_their_result(tokenizer: Any, tmp_path: Path) -> None:
    backend = ReplayBackend(tokenizer, [REPLIES[0], TOOL_CALL, REPLIES[1]])
    session = open_session(backend, tmp_path, kv_budget="2000tok", tools=True, max_tokens=32)
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "What are tides?")
        await send(app, pilot, "Remind me about tides.")
        chat = app.chat.query_one(ChatLog)
        seen["calls"] = [(v.tool_name, v.arguments, v.collapsed, v.ok, v.result) for v in chat.tool_calls]
        seen["replies"] = [(r.turn, r.text.strip()) for r in chat.replies]

    run_app(session, scenario)
    ((name, arguments, collapsed, ok, result),) = seen["calls"]
    assert (name, arguments, collapsed, ok) == ("recall", {"query": "tides"}, True, True)
    stored = [m.content for m in session.context.messages() if m.role == "tool"]
    assert len(stored) == 1 and json.loads(stored[0].split("\n")[1])["content"] == result
    assert "What are tides?" in result  # the recall found turn 1
    assert seen["replies"] == [(1, REPLIES[0]), (2, "Let me check my notes."), (2, REPLIES[1])]


def test_compact_command_runs_on_the_worker(tokenizer: Any, tmp_path: Path) -> None:
    session = open_session(ReplayBackend(tokenizer, REPLIES), tmp_path, kv_budget="2000tok")
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "What are tides?")
        await send(app, pilot, "And coral reefs?")
        await send(app, pilot, "/compact the names")
        seen["notices"] = [n.text for n in app.chat.query_one(ChatLog).notices if n.kind == "compaction"]
        seen["map"] = [(t.turn, t.state) for t in app.chat.query_one(TurnMap).turns]
        await send(app, pilot, "/compact")  # nothing left to compact: said so
        seen["notes"] = notifications(app)

    run_app(session, scenario)
    (compaction,) = session.store.compactions(session.session_id)
    assert compaction.trigger == "manual" and compaction.focus == "the names"
    assert seen["notices"] == [
        f"⟲ compacted turns 1–2: {compaction.tokens_before:,} → {compaction.tokens_after:,} tokens"
    ]
    assert seen["map"] == [(1, "summarized"), (2, "summarized")]
    assert any(n.startswith("nothing to compact") for n in seen["notes"])


def test_compaction_notice_says_how_many_facts_it_kept(tokenizer: Any, tmp_path: Path) -> None:
    session = open_session(ReplayBackend(tokenizer, REPLIES), tmp_path, kv_budget="2000tok")
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "My cat is called Pixel and my locker code is 4817.")
        await send(app, pilot, "/compact")
        seen["notices"] = [n.text for n in app.chat.query_one(ChatLog).notices if n.kind == "compaction"]

    run_app(session, scenario)
    (compaction,) = session.store.compactions(session.session_id)
    assert [f["text"] for f in compaction.ledger] == ["Pixel", "4817"]
    assert seen["notices"] == [
        f"⟲ compacted turn 1: {compaction.tokens_before:,} → {compaction.tokens_after:,} tokens, "
        "kept 2 facts verbatim"
    ]


def test_stats_screen_shows_the_session_totals(tokenizer: Any, tmp_path: Path) -> None:
    session = open_session(ReplayBackend(tokenizer, REPLIES), tmp_path, kv_budget="2000tok")
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "What are tides?")
        await send(app, pilot, "/stats")
        seen["screen"] = app.screen

    run_app(session, scenario)
    screen = seen["screen"]
    assert isinstance(screen, StatsScreen)
    request = session.store.requests(session.session_id)[-1]
    assert "| requests | 1 (0 summaries) |" in screen.markdown
    assert f"| generated tokens | {request['generated_tokens']:,} |" in screen.markdown
    assert "| blocks | 0 used · " in screen.markdown


def test_stats_screen_shows_the_cost_slope_once_it_can_be_fitted(tokenizer: Any, tmp_path: Path) -> None:
    session = open_session(ReplayBackend(tokenizer, REPLIES), tmp_path, kv_budget="2000tok")
    seen: dict[str, str] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "What are tides?")
        await send(app, pilot, "/stats")
        seen["early"] = app.screen.markdown  # type: ignore[attr-defined]
        app.pop_screen()
        for question in ("And reefs?", "How deep is the sea?", "What about kelp?"):
            await send(app, pilot, question)
        await send(app, pilot, "/stats")
        seen["later"] = app.screen.markdown  # type: ignore[attr-defined]

    run_app(session, scenario)
    assert "## Cost slope" in seen["early"] and "Not enough turns yet" in seen["early"]
    assert "decode ms/token" in seen["later"] and "per 1k ctx" in seen["later"]


def test_latency_panel_says_what_speculation_accepted(tokenizer: Any, tmp_path: Path) -> None:
    """Beside the decode speed, the tokens a verification step accepted on average in the last
    turn; a resumed session shows it from its stored requests; a turn that guessed nothing (or a
    backend that does not speculate) leaves the row as it always was."""
    drafts = (4, 16, 10)  # 10 of 16 guesses accepted over 4 steps: 1 + 10/4 = 3.5 tokens a step
    session = open_session(ReplayBackend(tokenizer, REPLIES, drafts=drafts), tmp_path, kv_budget="2000tok")
    seen: dict[str, Any] = {}

    def accepted(app: LiubaiApp) -> tuple[bool, str]:
        label = app.chat.query_one(LatencyPanel).query_one("#accepted", Label)
        return bool(label.display), str(label.render())

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        seen["before"] = accepted(app)[0]
        await send(app, pilot, "What are tides?")
        seen["after"] = accepted(app)
        seen["decode"] = str(app.chat.query_one("#value-decode", Label).render())

    run_app(session, scenario)
    assert seen["before"] is False
    assert seen["after"] == (True, "· accepted 3.5") and seen["decode"].endswith("tok/s")

    resumed = open_session(
        ReplayBackend(tokenizer, REPLIES), tmp_path, session.session_id, kv_budget="2000tok"
    )

    async def again(app: LiubaiApp, pilot: Pilot[None]) -> None:
        seen["resumed"] = accepted(app)
        await send(app, pilot, "And coral reefs?")
        seen["plain"] = accepted(app)[0]

    run_app(resumed, again)
    assert seen["resumed"] == (True, "· accepted 3.5") and seen["plain"] is False


def test_remote_backend_shows_what_it_knows_and_na_for_the_rest(tokenizer: Any, tmp_path: Path) -> None:
    session = open_session(ReplayBackend(tokenizer, REPLIES, remote=True), tmp_path, kv_budget="2000tok")
    seen: dict[str, str] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "What are tides?")
        seen["gauge"] = str(app.chat.query_one(KVGauge).render())
        seen["pool"] = str(app.chat.query_one(PoolPanel).render())

    run_app(session, scenario)
    kv_tokens = session.store.requests(session.session_id)[-1]["kv_tokens"]
    assert f"{kv_tokens:,} / 2,000 tok" in seen["gauge"]
    assert "bytes n/a" in seen["gauge"] and "K n/a · V n/a · B/tok n/a" in seen["gauge"]
    assert "blocks n/a" in seen["pool"] and "hit last 0% (0/" in seen["pool"]


class CompiledReplayBackend(ReplayBackend):
    """A replay backend whose decode step runs compiled until the test says it fell back."""

    compiled_step = True

    @property
    def compiled(self) -> bool | None:
        return self.compiled_step


def test_latency_panel_says_how_the_engine_runs(tokenizer: Any, tmp_path: Path) -> None:
    """The latency panel's subtitle names the weight format and whether decode steps are compiled,
    from the start; after a turn whose step fell back to eager it says eager; a remote backend,
    which reports neither, leaves it empty."""
    backend = CompiledReplayBackend(tokenizer, REPLIES)
    session = open_session(backend, tmp_path, kv_budget="2000tok")
    seen: dict[str, str] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        seen["start"] = str(app.chat.query_one(LatencyPanel).border_subtitle)
        backend.compiled_step = False
        await send(app, pilot, "What are tides?")
        seen["after"] = str(app.chat.query_one(LatencyPanel).border_subtitle)

    run_app(session, scenario)
    assert seen == {"start": "bfloat16 · compiled", "after": "bfloat16 · eager"}

    remote_backend = ReplayBackend(tokenizer, REPLIES, remote=True)
    remote = open_session(remote_backend, tmp_path, kv_budget="2000tok", db=str(tmp_path / "remote.db"))

    async def remote_scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "What are tides?")
        seen["remote"] = str(app.chat.query_one(LatencyPanel).border_subtitle)

    run_app(remote, remote_scenario)
    assert seen["remote"] == ""


def test_ctrl_q_quits_with_0_and_ctrl_c_twice_with_130(tokenizer: Any, tmp_path: Path) -> None:
    session = open_session(ReplayBackend(tokenizer, REPLIES), tmp_path, kv_budget="2000tok")
    seen: dict[str, Any] = {}

    def pressing(*keys: str) -> Scenario:
        async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
            await pilot.press(*keys)
            await pilot.pause()
            seen[" ".join(keys)] = (app.is_running, app.return_code, notifications(app))

        return scenario

    assert run_app(session, pressing("ctrl+q")).return_code == 0
    running, code, notes = run_app(session, pressing("ctrl+c")) and seen["ctrl+c"]
    assert running and code is None and any("Ctrl-C again" in n for n in notes)
    assert run_app(session, pressing("ctrl+c", "ctrl+c")).return_code == 130


def test_errors_are_notifications_not_tracebacks(tokenizer: Any, tmp_path: Path) -> None:
    """A backend that fails mid-reply: the error is a notification and the app stays usable."""

    class FailingBackend(ReplayBackend):
        def stream(self, prompt: Any, params: Any) -> Any:
            yield from list(super().stream(prompt, params))[:2]
            from runtime.errors import EngineError

            raise EngineError("the engine fell over")

    session = open_session(FailingBackend(tokenizer, REPLIES), tmp_path, kv_budget="2000tok")
    seen: dict[str, Any] = {}

    async def scenario(app: LiubaiApp, pilot: Pilot[None]) -> None:
        await send(app, pilot, "What are tides?")
        seen["notes"] = notifications(app)
        seen["streaming"] = app.chat.query_one(ChatLog).streaming
        await pilot.press(*"/help", "enter")
        seen["help"] = isinstance(app.screen, HelpScreen)

    run_app(session, scenario)
    assert "the engine fell over" in seen["notes"]
    assert seen["streaming"] is False and seen["help"] is True
    assert [m.role for m in session.context.messages() if m.turn == 1] == [
        "user"
    ]  # stored before the failure


def test_run_chat_unknown_session_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = AgentConfig(db=str(tmp_path / "t.db"), tools=False)
    assert run_chat(config, "no-such-session") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("liubai: error: ") and "no-such-session" in err[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/compact", SlashCommand("compact")),
        ("/compact the names", SlashCommand("compact", "the names")),
        ("/PIN 3", SlashCommand("pin", "3")),
        ("/budget 24MiB", SlashCommand("budget", "24MiB")),
        ("/export out/chat.jsonl", SlashCommand("export", "out/chat.jsonl")),
        ("  /clear ", SlashCommand("clear")),
    ],
)
def test_parse_command(text: str, expected: SlashCommand) -> None:
    assert parse_command(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("/pin", "usage: /pin N"),
        ("/pin x", "turn number"),
        ("/pin 0", "turn number"),
        ("/clear now", "takes no argument"),
        ("/export chat.txt", ".md"),
        ("/frobnicate", "unknown command /frobnicate"),
    ],
)
def test_parse_command_errors(text: str, message: str) -> None:
    with pytest.raises(CommandError, match=message):
        parse_command(text)
