"""The context manager's commands and bookkeeping, on a tiny random model.

The tiny model writes gibberish, which is all these tests need from it: summaries are real
requests on a real engine (so their KV is real), while what is asserted is layout, states and
records. The conversation itself is scripted; only compaction asks the model for anything.
"""

import sqlite3
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from memory import BudgetError, CompactionEvent, ContextManager, Store, StoreError
from memory.prompt_layout import SUMMARY_HEADER
from runtime import Engine, SamplingParams
from runtime.backends.backend import ChatPrompt, LocalBackend
from runtime.engine.engine import CompletionDelta
from runtime.engine.metrics import EngineStats

SYSTEM = "You are a helpful assistant."


class RecordingBackend:
    """The tiny engine behind the backend interface, keeping every prompt it was sent."""

    kind = "local"

    def __init__(self, engine: Engine) -> None:
        self.inner = LocalBackend(engine)
        self.model_name = self.inner.model_name
        self.prompts: list[ChatPrompt] = []

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def bytes_per_token(self) -> int:
        return self.inner.bytes_per_token

    @property
    def kv_dtypes(self) -> tuple[str, str]:
        return self.inner.kv_dtypes

    @property
    def max_context_tokens(self) -> int:
        return self.inner.max_context_tokens

    def stream(self, prompt: ChatPrompt, params: SamplingParams) -> Generator[CompletionDelta, None, None]:
        self.prompts.append(prompt)
        yield from self.inner.stream(prompt, params)

    def stats(self) -> EngineStats:
        return self.inner.stats()


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> Engine:
    return Engine(model=str(tiny_llama_path), kv_pool="32MiB", device="cpu", dtype="float32")


@pytest.fixture
def backend(engine: Engine) -> RecordingBackend:
    return RecordingBackend(engine)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "liubai.db")
    yield store
    store.close()


def user_text(turn: int) -> str:
    return f"Turn {turn}: " + " ".join(f"word{turn}x{i}" for i in range(12))


def chat(manager: ContextManager, turns: range) -> None:
    """Scripted turns: each builds its prompt (compacting if needed) and gets a canned reply."""
    for turn in turns:
        manager.add_user(user_text(turn))
        prompt = manager.next_prompt()
        assert sum(prompt.sections.values()) == prompt.num_tokens
        manager.add_assistant(f"Reply {turn}: noted.")


def make(store: Store, backend: RecordingBackend, budget: str = "1024tok", **options: Any) -> ContextManager:
    return ContextManager.create(store, backend, system=SYSTEM, budget=budget, **options)


def states(manager: ContextManager) -> dict[int, str]:
    return {t.turn: t.state for t in manager.turn_map()}


def test_pinned_turn_survives_compaction_in_the_pinned_section(
    store: Store, backend: RecordingBackend
) -> None:
    manager = make(store, backend)
    chat(manager, range(1, 6))
    manager.pin(2)
    event = manager.compact()
    assert event is not None and event.turns == [1, 3, 4, 5]
    assert states(manager) == {1: "summarized", 2: "live", 3: "summarized", 4: "summarized", 5: "summarized"}
    manager.add_user("And now?")
    prompt = manager.next_prompt()
    turn2 = [m for m in manager.messages() if m.turn == 2]
    assert prompt.sections["pinned"] == sum(m.token_count for m in turn2)
    assert prompt.sections["recent"] == 0
    # [system] [pinned turn 2] [summary] [new message]
    assert [m["content"] for m in prompt.messages[1:3]] == [m.content for m in turn2]
    assert prompt.messages[3]["content"].startswith(SUMMARY_HEADER)
    assert prompt.messages[-1] == {"role": "user", "content": "And now?"}
    assert sum(prompt.sections.values()) == prompt.num_tokens

    manager.add_assistant("Fine.")
    manager.unpin(2)
    assert manager.compact() is not None
    assert states(manager)[2] == "summarized"


def test_pinned_turn_between_compacted_ones_moves_to_the_pinned_section(
    store: Store, backend: RecordingBackend
) -> None:
    """Regression: a pinned turn is never compacted, so an auto compaction of turns 1-5 skipped
    it, and the new window started at the pinned turn itself: it stayed behind the summary,
    counted as a recent turn, instead of in the pinned section."""
    manager = make(store, backend, budget="2048tok")
    chat(manager, range(1, 5))
    manager.pin(3)
    chat(manager, range(5, 40))
    assert manager.store.compactions(manager.session_id), "the chat should have been compacted"
    assert states(manager)[3] == "live"
    manager.add_user("Still there?")
    prompt = manager.next_prompt()
    assert prompt.sections["pinned"] == sum(m.token_count for m in manager.messages() if m.turn == 3)
    assert prompt.messages[1]["content"] == user_text(3)


def test_pinning_an_evicted_turn_brings_it_back(store: Store, backend: RecordingBackend) -> None:
    manager = make(store, backend)
    chat(manager, range(1, 4))
    manager.compact()
    assert states(manager)[1] == "summarized"
    manager.pin(1)
    assert states(manager)[1] == "live"
    assert [t.pinned for t in manager.turn_map()] == [True, False, False]
    manager.add_user("What did I say first?")
    prompt = manager.next_prompt()
    assert prompt.messages[1] == {"role": "user", "content": user_text(1)}
    assert prompt.sections["pinned"] > 0
    with pytest.raises(ValueError, match="there is no turn 9"):
        manager.pin(9)


def test_manual_compact_with_focus_reaches_the_summarizer(store: Store, backend: RecordingBackend) -> None:
    events: list[CompactionEvent] = []
    manager = make(store, backend, on_event=events.append)
    chat(manager, range(1, 4))
    before = manager.context_tokens()
    event = manager.compact(focus="the lighthouse keeper's name")
    assert event is not None and events == [event]
    assert event.trigger == "manual" and event.focus == "the lighthouse keeper's name"
    assert event.tokens_before == before and event.tokens_after == manager.context_tokens()
    assert backend.prompts, "the summary is asked of the model"
    asked = [p.messages[-1]["content"] for p in backend.prompts]
    assert user_text(2) in asked[0]  # the fold of the transcript, then any shortening of the result
    assert all("Pay particular attention to: the lighthouse keeper's name" in text for text in asked)
    (record,) = store.compactions(manager.session_id)
    assert record.trigger == "manual" and record.focus == "the lighthouse keeper's name"
    assert manager.summary is not None
    assert manager.compact() is None  # nothing live is left to compact
    # the user turns' word1x0-like words are identifiers: the ledger keeps those that fit
    kept = len(event.ledger)
    assert kept == len(record.ledger) > 0 and all(f["text"] in manager.summary for f in event.ledger)
    description = (
        f"compacted turns 1–3: {before:,} → {event.tokens_after:,} tokens, kept {kept} facts verbatim"
    )
    assert event.to_dict()["description"] == event.describe() == description


def test_clear_evicts_everything_unpinned_but_keeps_it_stored(
    store: Store, backend: RecordingBackend
) -> None:
    manager = make(store, backend)
    chat(manager, range(1, 4))
    manager.compact()
    chat(manager, range(4, 6))
    manager.pin(5)
    event = manager.clear()
    assert event is not None and event.trigger == "clear" and event.summarized_ids == []
    assert manager.summary is None
    assert states(manager) == {1: "summarized", 2: "summarized", 3: "summarized", 4: "evicted", 5: "live"}
    manager.add_user("Fresh start.")
    prompt = manager.next_prompt()
    assert prompt.sections["summary"] == prompt.sections["recent"] == 0
    expected = [SYSTEM, user_text(5), "Reply 5: noted.", "Fresh start."]
    assert [m["content"] for m in prompt.messages] == expected
    stored = [m.content for m in store.messages(manager.session_id) if m.kind == "chat"]
    assert stored[:2] == [user_text(1), "Reply 1: noted."] and len(stored) == 11
    assert store.get_session(manager.session_id).summary_id is None


def test_turn_map_reports_live_summarized_evicted_and_pinned(store: Store, backend: RecordingBackend) -> None:
    manager = make(store, backend)
    chat(manager, range(1, 3))
    manager.compact()
    chat(manager, range(3, 5))
    manager.clear()
    chat(manager, range(5, 6))
    manager.pin(5)
    rows = manager.turn_map()
    assert [(r.turn, r.state, r.pinned) for r in rows] == [
        (1, "summarized", False),
        (2, "summarized", False),
        (3, "evicted", False),
        (4, "evicted", False),
        (5, "live", True),
    ]
    assert rows[0].preview.startswith("Turn 1:") and all(r.tokens > 0 for r in rows)


def test_auto_compaction_keeps_requests_inside_the_budget(store: Store, backend: RecordingBackend) -> None:
    seen: list[tuple[str, int]] = []
    manager = make(store, backend, on_request=lambda kind, metrics, kv: seen.append((kind, kv)))
    for turn in range(1, 30):
        manager.add_user(user_text(turn))
        prompt = manager.next_prompt()
        assert prompt.num_tokens + prompt.max_tokens == 1024
        assert prompt.num_tokens <= manager.budget.high_tokens
        manager.add_assistant(f"Reply {turn}: noted.")
    assert seen and all(kind == "summary" and kv <= 1024 for kind, kv in seen)
    assert len(store.compactions(manager.session_id)) >= 2


def test_set_budget_changes_the_next_prompt(store: Store, backend: RecordingBackend) -> None:
    manager = make(store, backend, budget="2048tok")
    chat(manager, range(1, 8))
    tokens = manager.context_tokens()
    manager.set_budget("600tok")
    assert manager.budget.tokens == 600
    assert store.get_session(manager.session_id).budget_spec == "600tok"
    manager.add_user("Shrunk.")
    prompt = manager.next_prompt()
    assert prompt.budget_tokens == 600 and prompt.compactions
    assert prompt.num_tokens < tokens and prompt.num_tokens + prompt.max_tokens == 600
    with pytest.raises(BudgetError):
        manager.set_budget("100tok")  # smaller than the system prompt plus the reserve
    with pytest.raises(BudgetError):
        manager.set_budget("a lot")
    assert manager.budget.tokens == 600


def test_resume_gives_the_same_next_prompt(store: Store, backend: RecordingBackend) -> None:
    manager = make(store, backend)
    chat(manager, range(1, 4))
    manager.compact()
    chat(manager, range(4, 6))
    manager.pin(4)
    manager.add_user(user_text(6))
    expected = manager.next_prompt()
    resumed = ContextManager.resume(store, backend, manager.session_id)
    again = resumed.next_prompt()
    assert again.token_ids == expected.token_ids
    assert again.sections == expected.sections and again.messages == expected.messages
    assert resumed.summary == manager.summary
    assert [(t.turn, t.state, t.pinned) for t in resumed.turn_map()] == [
        (t.turn, t.state, t.pinned) for t in manager.turn_map()
    ]


def test_turn_that_cannot_fit_is_refused_before_compacting(store: Store, backend: RecordingBackend) -> None:
    manager = make(store, backend, budget="600tok")
    chat(manager, range(1, 3))
    manager.add_user("long " * 700)
    with pytest.raises(BudgetError, match="the current turn and the pinned turns alone do not fit"):
        manager.next_prompt()
    assert store.compactions(manager.session_id) == []  # nothing was summarized for nothing
    assert backend.prompts == []


def test_failed_compaction_write_drops_nothing(
    store: Store, backend: RecordingBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make(store, backend)
    chat(manager, range(1, 4))
    live_before = [m.id for m in manager.live_messages()]
    store.db.execute("PRAGMA busy_timeout = 50")
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError, match="locked"):
            manager.compact()
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert [m.id for m in manager.live_messages()] == live_before
    assert manager.summary is None and store.compactions(manager.session_id) == []
    assert manager.compact() is not None


def test_recall_note_sits_before_the_question_it_serves(store: Store, backend: RecordingBackend) -> None:
    manager = make(store, backend)
    manager.add_user("Please remember: the harbour master is called Ingeborg Vantongeren.")
    manager.next_prompt()
    manager.add_assistant("Noted.")
    chat(manager, range(2, 4))
    manager.compact()
    manager.add_user("What is the harbour master called?")
    prompt = manager.next_prompt()
    assert [h.turn for h in prompt.recalled] == [1]
    note = prompt.messages[-2]
    assert note["role"] == "system" and "Ingeborg Vantongeren" in note["content"]
    assert prompt.sections["recalled"] > 0
    manager.add_assistant("Ingeborg.")
    manager.add_user("Thanks, and what else?")
    later = manager.next_prompt()
    assert later.token_ids[: prompt.num_tokens] == prompt.token_ids  # the note stayed where it was
    assert later.recalled == []


def test_served_recall_note_leaves_at_the_next_compaction(store: Store, backend: RecordingBackend) -> None:
    """The note served its reply; at the next compaction it goes even though its turn stays live."""
    manager = make(store, backend, budget="2048tok")
    manager.add_user("Please remember: the harbour master is called Ingeborg Vantongeren.")
    manager.next_prompt()
    manager.add_assistant("Noted.")
    manager.compact()
    chat(manager, range(2, 20))
    manager.add_user("What is the harbour master called?")
    assert [h.turn for h in manager.next_prompt().recalled] == [1]
    manager.add_assistant("Ingeborg.")
    question_turn = manager.current_turn
    [note] = [m for m in manager.live_messages() if m.kind == "recall"]
    events: list[CompactionEvent] = []
    turn = question_turn
    while not events:
        turn += 1
        manager.add_user(user_text(turn))
        events = manager.next_prompt().compactions
        manager.add_assistant(f"Reply {turn}: noted.")
    [event] = events
    assert question_turn not in event.turns and states(manager)[question_turn] == "live"
    assert note.id in event.evicted_ids
    assert [m for m in manager.live_messages() if m.kind == "recall"] == []
    stored = {m.id: m for m in store.messages(manager.session_id)}
    assert stored[note.id].state == "evicted" and "Ingeborg Vantongeren" in stored[note.id].content


def test_recall_can_be_switched_off(store: Store, backend: RecordingBackend) -> None:
    manager = make(store, backend, recall=False)
    manager.add_user("Please remember: the harbour master is called Ingeborg Vantongeren.")
    manager.add_assistant("Noted.")
    manager.compact()
    manager.add_user("What is the harbour master called?")
    prompt = manager.next_prompt()
    assert prompt.recalled == [] and prompt.sections["recalled"] == 0
    assert {h.turn for h in manager.search("harbour master")} == {1, 2}
