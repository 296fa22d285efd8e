"""The memory layer end to end on the real default model: one scripted 40-turn chat under a
4,096-token budget, run once per module and read by every test here.

The chat plants five distinctive facts in its early turns, talks about other things long enough
for those turns to be compacted, then asks about each fact. What is asserted never depends on
the model's quality: the KV each request holds (the chat's own and the summarizer's), the store
keeping every message byte for byte, recall putting each fact's original text in the prompt,
and each prompt extending the previous one so that the engine's prefix cache serves it.
"""

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memory import BuiltPrompt, CompactionEvent, ContextManager, Store
from runtime import Engine, SamplingParams
from runtime.backends.backend import LocalBackend
from runtime.engine.metrics import RequestMetrics

pytestmark = pytest.mark.model

BUDGET = 4096
NUM_TURNS = 40
REPLY_TOKENS = 24
SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True, slots=True)
class Fact:
    turn: int
    text: str
    question: str
    key: str


FACTS = [
    Fact(2, "Please remember this: my storage locker code is 4817.", "What is my storage locker code?",
         "4817"),
    Fact(3, "My sister is called Ottoline Fairweather.", "What is my sister called?", "Ottoline"),
    Fact(4, "The wifi password at the cabin is marmalade77.", "What is the wifi password at the cabin?",
         "marmalade77"),
    Fact(5, "My dentist appointment is on the 14th of March.", "When is my dentist appointment?", "14th"),
    Fact(6, "Our secret project codename is Bluefinch.", "What is our secret project codename?", "Bluefinch"),
]  # fmt: skip
QUESTION_TURNS = range(NUM_TURNS - len(FACTS) + 1, NUM_TURNS + 1)

_VOCAB = (
    "garden river stone window bread lamp orange carpet village teacher music pencil forest "
    "mountain cloud bicycle kitchen letter harbour painting candle meadow engine library "
    "blanket station ribbon copper valley lantern"
).split()


def filler(turn: int, num_words: int = 60) -> str:
    """A made-up, deterministic user message sharing no content word with the facts."""
    rng = random.Random(turn)
    words = " ".join(rng.choice(_VOCAB) for _ in range(num_words))
    return f"Turn {turn} notes: {words}. Say one short sentence about these notes."


def script() -> list[str]:
    messages = [filler(turn) for turn in range(1, NUM_TURNS + 1)]
    for fact in FACTS:
        messages[fact.turn - 1] = fact.text
    for fact, turn in zip(FACTS, QUESTION_TURNS, strict=True):
        messages[turn - 1] = fact.question
    return messages


@dataclass(slots=True)
class Turn:
    number: int
    prompt: BuiltPrompt
    metrics: RequestMetrics
    reply: str
    fact_states: dict[str, str]  # the fact's message state when this turn's prompt was built


@dataclass(slots=True)
class Chat:
    manager: ContextManager
    db_path: Path
    added: list[tuple[str, str]]
    turns: list[Turn] = field(default_factory=list)
    events: list[CompactionEvent] = field(default_factory=list)
    requests: list[tuple[str, int]] = field(default_factory=list)  # (kind, prompt + generated)


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Engine:
    return Engine(model=str(default_model_path), kv_pool="256MiB")


@pytest.fixture(scope="module")
def chat(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Chat:
    db_path = tmp_path_factory.mktemp("memory") / "chat.db"
    store = Store(db_path)
    events: list[CompactionEvent] = []
    requests: list[tuple[str, int]] = []

    def on_request(kind: str, metrics: RequestMetrics, kv_tokens: int) -> None:
        # The engine's own count of what the request held, not memory's.
        requests.append((kind, metrics.num_prompt_tokens + metrics.num_generated_tokens))

    manager = ContextManager.create(
        store,
        LocalBackend(engine),
        system=SYSTEM,
        budget=f"{BUDGET}tok",
        on_event=events.append,
        on_request=on_request,
    )
    result = Chat(manager, db_path, added=[], events=events, requests=requests)
    fact_ids: dict[str, int] = {}
    for number, text in enumerate(script(), start=1):
        message = manager.add_user(text)
        result.added.append(("user", text))
        for fact in FACTS:
            if fact.turn == number:
                fact_ids[fact.key] = message.id
        prompt = manager.next_prompt()
        states = {m.id: m.state for m in manager.messages()}
        parts: list[str] = []
        metrics: RequestMetrics | None = None
        params = SamplingParams(max_tokens=min(REPLY_TOKENS, prompt.max_tokens), temperature=0.0)
        for delta in engine.stream(prompt.token_ids, params):
            parts.append(delta.text)
            metrics = delta.metrics or metrics
        assert metrics is not None
        assert metrics.num_prompt_tokens == prompt.num_tokens
        requests.append(("turn", metrics.num_prompt_tokens + metrics.num_generated_tokens))
        reply = "".join(parts)
        manager.add_assistant(reply)
        result.added.append(("assistant", reply))
        fact_states = {key: states[i] for key, i in fact_ids.items()}
        result.turns.append(Turn(number, prompt, metrics, reply, fact_states))
    return result


def test_kv_never_exceeds_the_budget_and_compaction_happens(chat: Chat) -> None:
    kinds = {kind for kind, _ in chat.requests}
    assert kinds == {"turn", "summary"}, "compaction's own summarization requests must be observed"
    assert len([k for k, _ in chat.requests if k == "turn"]) == NUM_TURNS
    worst = max(kv for _, kv in chat.requests)
    assert worst <= BUDGET, f"a request held {worst} KV tokens, over the budget of {BUDGET}"
    assert chat.events and all(e.trigger == "auto" for e in chat.events)
    assert sum(len(t.prompt.compactions) for t in chat.turns) == len(chat.events)
    for event in chat.events:
        assert event.tokens_after < event.tokens_before
        assert event.summarized_ids and event.num_requests >= 1
    assert chat.manager.summary


def test_every_message_is_in_the_database_byte_for_byte(chat: Chat) -> None:
    reopened = Store(chat.db_path)
    try:
        stored = reopened.messages(chat.manager.session_id)
        assert [(m.role, m.content) for m in stored if m.kind == "chat"] == chat.added
        assert {m.state for m in stored} >= {"live", "summarized"}
        compactions = reopened.compactions(chat.manager.session_id)
        assert len(compactions) == len(chat.events)
        dropped = {i for c in compactions for i in c.dropped_ids}
        assert dropped == {m.id for m in stored if m.state != "live"}
    finally:
        reopened.close()


def test_planted_facts_come_back_through_recall(chat: Chat) -> None:
    for fact, number in zip(FACTS, QUESTION_TURNS, strict=True):
        turn = chat.turns[number - 1]
        assert turn.fact_states[fact.key] != "live", f"turn {fact.turn} should have left the live context"
        assert fact.text in [hit.content for hit in turn.prompt.recalled]
        note_index = next(
            i
            for i, m in enumerate(turn.prompt.messages)
            if m["role"] == "system" and fact.text in m["content"]
        )
        # The note sits directly before the question it serves.
        assert turn.prompt.messages[note_index + 1] == {"role": "user", "content": fact.question}
        assert turn.prompt.sections["recalled"] > 0


def test_prompts_extend_each_other_and_hit_the_prefix_cache(chat: Chat, engine: Engine) -> None:
    block = engine.config.block_size
    pairs = 0
    for before, after in zip(chat.turns, chat.turns[1:], strict=False):
        if after.prompt.compactions:
            continue
        ids = before.prompt.token_ids
        assert after.prompt.token_ids[: len(ids)] == ids, f"turn {after.number} rewrote turn {before.number}"
        assert after.metrics.num_cached_tokens >= len(ids) // block * block
        pairs += 1
    assert pairs >= NUM_TURNS - 1 - len(chat.events)


def test_sections_add_up_and_replies_fit(chat: Chat) -> None:
    for turn in chat.turns:
        prompt = turn.prompt
        assert sum(prompt.sections.values()) == prompt.num_tokens
        assert prompt.max_tokens == BUDGET - prompt.num_tokens
        assert turn.metrics.num_generated_tokens <= REPLY_TOKENS
    first = next(t.number for t in chat.turns if t.prompt.compactions)
    assert all(t.prompt.sections["summary"] > 0 for t in chat.turns[first - 1 :])
    assert all(t.prompt.sections["summary"] == 0 for t in chat.turns[: first - 1])
