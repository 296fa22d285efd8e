"""Snapshots of the chat's look, with every live figure frozen.

A :class:`ReplayBackend` stands in for the engine: it answers from a fixed list of replies (and a
fixed summary when the context manager asks for one), with metrics computed from the prompt's
length, a prefix cache that hits the previous prompt's whole blocks, and pool stats derived the
same way, so every number on screen is the same on every run. Everything above the backend is
real: the agent session, the context manager, the store. The session id is pinned too.

These guard the look only; what the app does is asserted in ``tests/test_tui.py``.
"""

import uuid
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Input

from agent.config import AgentConfig
from agent.session import AgentSession
from memory.store import Store
from runtime.backends.backend import ChatPrompt
from runtime.engine.engine import CompletionDelta
from runtime.engine.metrics import EngineStats, RequestMetrics
from runtime.engine.sampling import SamplingParams
from tui.app import LiubaiApp

BLOCK_SIZE = 16
NUM_BLOCKS = 512
SUMMARY = "The user asked about the ocean; the assistant described tides and reefs."
TERMINAL = (130, 40)


class ReplayBackend:
    """A backend with a real tokenizer and scripted replies; ``remote=True`` plays a server."""

    def __init__(
        self,
        tokenizer: Any,
        replies: list[str],
        remote: bool = False,
        drafts: tuple[int, int, int] | None = None,
    ) -> None:
        """``drafts``: every reply's (num_drafts, num_draft_tokens, num_accepted_tokens), as a
        speculating engine counts them; None: no speculation."""
        self.drafts = drafts
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.kind = "openai" if remote else "local"
        self.model_name = "replay-135m"
        self.remote = remote
        self.num_requests = 0
        self._previous: list[int] = []
        self._queried = self._hit = 0

    @property
    def bytes_per_token(self) -> int | None:
        return None if self.remote else 23040

    @property
    def kv_dtypes(self) -> tuple[str | None, str | None]:
        return (None, None) if self.remote else ("bfloat16", "int8")

    @property
    def weight_format(self) -> str | None:
        return None if self.remote else "bfloat16"

    @property
    def compiled(self) -> bool | None:
        return None if self.remote else False

    @property
    def speculate(self) -> str | None:
        return None if self.remote else "off" if self.drafts is None else "ngram"

    @property
    def wide_step_rows(self) -> None:
        return None

    @property
    def max_context_tokens(self) -> int | None:
        return None if self.remote else 8192

    def stream(self, prompt: ChatPrompt, params: SamplingParams) -> Generator[CompletionDelta, None, None]:
        ids = prompt.token_ids or []
        system = prompt.messages[0]["content"] if prompt.messages else ""
        if system.startswith(("You keep the running summary", "Shorten this summary")):
            text = SUMMARY
        else:
            text = self.replies[self.num_requests % len(self.replies)]
            self.num_requests += 1
        words = text.split(" ")[: params.max_tokens]
        for i, word in enumerate(words):
            yield CompletionDelta("replay", [i], word if i == 0 else f" {word}")
        common = 0
        for a, b in zip(ids, self._previous, strict=False):
            if a != b:
                break
            common += 1
        cached = min(common, len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        self._previous = ids + list(range(len(words)))
        self._queried += len(ids)
        self._hit += cached
        prefilled = len(ids) - cached
        num_drafts, num_draft_tokens, num_accepted_tokens = self.drafts or (0, 0, 0)
        metrics = RequestMetrics(
            num_prompt_tokens=len(ids),
            num_cached_tokens=cached,
            num_prefilled_tokens=prefilled,
            prefill_ms=prefilled * 0.5,
            ttft_ms=prefilled * 0.5 + 4.0,
            num_generated_tokens=len(words),
            decode_ms=(len(words) - 1) * 40.0,
            num_drafts=num_drafts,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
        )
        yield CompletionDelta("replay", [], "", finished=True, finish_reason="stop", metrics=metrics)

    def stats(self) -> EngineStats | None:
        if self.remote:
            return None
        cached = -(-len(self._previous) // BLOCK_SIZE)
        return EngineStats(
            block_size=BLOCK_SIZE,
            num_blocks_total=NUM_BLOCKS,
            num_blocks_used=0,
            num_blocks_cached=cached,
            num_blocks_free=NUM_BLOCKS - cached,
            kv_tokens_in_use=0,
            kv_bytes_in_use=0,
            kv_pool_bytes=NUM_BLOCKS * BLOCK_SIZE * 23040,
            bytes_per_token=23040,
            k_dtype="bfloat16",
            v_dtype="int8",
            prefix_queried_tokens=self._queried,
            prefix_hit_tokens=self._hit,
            prefix_hittable_tokens=self._queried,
            num_preemptions=0,
            max_batch_size=1,
            num_running=0,
            num_waiting=0,
        )


TOOL_CALL = (
    'Let me check my notes. <tool_call>{"name": "recall", "arguments": {"query": "tides"}}</tool_call>'
)
REPLIES = [
    "Tides are the **rise and fall** of the sea, pulled by the Moon.\n\n- two highs a day\n- two lows",
    "Coral reefs are built by tiny animals called *polyps* over thousands of years.",
    "The deepest point is the Challenger Deep, about 11 km down.",
    "Kelp forests grow in cold, clear water near the coast.",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture
def fixed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session ids come from uuid4: pin them so the header is the same on every run."""
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0x5EED))


def replay_session(
    tokenizer: Any,
    tmp_path: Path,
    *,
    remote: bool = False,
    replies: list[str] = REPLIES,
    drafts: tuple[int, int, int] | None = None,
    **options: Any,
) -> AgentSession:
    config = AgentConfig(**{"max_tokens": 32, "tools": False, "db": str(tmp_path / "replay.db"), **options})
    backend = ReplayBackend(tokenizer, replies, remote=remote, drafts=drafts)
    return AgentSession.open(backend, Store(config.db), config)  # type: ignore[arg-type]


async def send(pilot: Pilot[None], text: str) -> None:
    """Put ``text`` in the input, press Enter, and wait until the app is idle again."""
    app = pilot.app
    assert isinstance(app, LiubaiApp)
    prompt = app.chat.query_one("#prompt", Input)
    # A blinking cursor is on or off depending on when the screenshot lands (a loaded machine
    # lands it in the off phase): hold it on.
    prompt.cursor_blink = False
    prompt.value = text
    await pilot.press("enter")
    for _ in range(6000):  # generous: a loaded CI machine must not snapshot a turn half done
        if app.chat.busy is None:
            break
        await pilot.pause(0.01)
    assert app.chat.busy is None, "the turn did not finish"
    await pilot.pause()


def test_snapshot_two_turns(snap_compare: Any, tokenizer: Any, tmp_path: Path, fixed_ids: None) -> None:
    """Two turns, the second with a tool call (collapsed); the gauge, pool, latency and turn map."""
    replies = [REPLIES[0], TOOL_CALL, REPLIES[1]]
    app = LiubaiApp(replay_session(tokenizer, tmp_path, replies=replies, kv_budget="2000tok", tools=True))

    async def run_before(pilot: Pilot[None]) -> None:
        await send(pilot, "What are tides?")
        await send(pilot, "And coral reefs?")

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)


def test_snapshot_compaction(snap_compare: Any, tokenizer: Any, tmp_path: Path, fixed_ids: None) -> None:
    """A small budget: the compaction notice inline, summarized turns in the map, one turn pinned."""
    app = LiubaiApp(replay_session(tokenizer, tmp_path, kv_budget="180tok"))

    async def run_before(pilot: Pilot[None]) -> None:
        await send(pilot, "What are tides?")
        await send(pilot, "/pin 1")
        for question in ("And coral reefs?", "How deep is it?", "What about kelp?"):
            await send(pilot, question)
        pilot.app.clear_notifications()
        await pilot.pause()

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)


def test_snapshot_remote_backend(snap_compare: Any, tokenizer: Any, tmp_path: Path, fixed_ids: None) -> None:
    """A remote backend knows no bytes per token and no pool: those figures read "n/a"."""
    app = LiubaiApp(replay_session(tokenizer, tmp_path, remote=True, kv_budget="2000tok"))

    async def run_before(pilot: Pilot[None]) -> None:
        await send(pilot, "What are tides?")

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)


def test_snapshot_speculation(snap_compare: Any, tokenizer: Any, tmp_path: Path, fixed_ids: None) -> None:
    """An engine that speculates: the latency panel's decode row also says how many tokens a
    verification step accepted on average (1 + 10/4 here)."""
    app = LiubaiApp(replay_session(tokenizer, tmp_path, kv_budget="2000tok", drafts=(4, 16, 10)))

    async def run_before(pilot: Pilot[None]) -> None:
        await send(pilot, "What are tides?")

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)


def test_snapshot_help(snap_compare: Any, tokenizer: Any, tmp_path: Path, fixed_ids: None) -> None:
    """/help over the chat."""
    app = LiubaiApp(replay_session(tokenizer, tmp_path, kv_budget="2000tok"))

    async def run_before(pilot: Pilot[None]) -> None:
        await send(pilot, "/help")

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)
