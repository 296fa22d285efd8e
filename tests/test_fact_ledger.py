"""The fact ledger: what extraction keeps and leaves out, the kept-verbatim list a compaction
writes into the summary (whatever the model's prose says), and recall through the ledger.

A scripted backend stands in for the model, so the summarizer's reply is known: it is the
issue's own bad summary, which keeps none of the names. Everything else is real: the context
manager, the store and the SmolLM2 tokenizer. The last test runs the issue's chat on the real
default model.
"""

from pathlib import Path
from typing import Any

import pytest

from memory import ContextManager, Store
from memory.fact_ledger import LEDGER_HEADER, extract_facts, prose_of
from memory.lexicon import expand, stem
from memory.prompt_layout import SUMMARY_HEADER
from memory.records import MessageRecord
from tests.scripted_backend import ScriptedBackend

BAD_SUMMARY = "A KV cache is a type of data caching that stores data for later use."
ISSUE_CHAT = [
    "My name is Ada and my cat is called Pixel.",
    "Tell me about rivers in Europe.",
    "What is a KV cache?",
    "How do transformers use attention?",
    "Explain paged memory in one sentence.",
    "What is quantization?",
]


def message(text: str, role: str = "user", message_id: int = 1, turn: int = 1) -> MessageRecord:
    return MessageRecord(message_id, "s", message_id, turn, role, "chat", text, 0, "live", False, False, "")


def facts(text: str, role: str = "user") -> list[tuple[str, str]]:
    return [(f.kind, f.text) for f in extract_facts(message(text, role))]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("My name is Ada and my cat is called Pixel.", [("name", "Ada"), ("name", "Pixel")]),
        ("My storage locker code is 4817.", [("number", "4817")]),
        ("The model took 3.5 GiB, 120 ms and cost $12.50 (15% less).",
         [("number", "3.5 GiB"), ("number", "120 ms"), ("number", "$12.50"), ("number", "15%")]),
        ("My dentist appointment is on the 14th of March.", [("date", "14th of March")]),
        ("We ship on 2024-05-01 at 10:30 am.", [("date", "2024-05-01"), ("date", "10:30 am")]),
        ("Logs are in /var/log/liubai/app.log and settings in config.toml.",
         [("path", "/var/log/liubai/app.log"), ("path", "config.toml")]),
        ("See https://example.org/docs?page=2 for details.", [("url", "https://example.org/docs?page=2")]),
        ("Call `load_model()` and set max_tokens with --kv-budget; parseArgs is old.",
         [("identifier", "load_model()"), ("identifier", "max_tokens"), ("identifier", "--kv-budget"),
          ("identifier", "parseArgs")]),
        ("The wifi password is marmalade77.", [("identifier", "marmalade77")]),
        ('She said "ship it on Friday" to us.', [("quoted", "ship it on Friday")]),
        ("Ottoline Fairweather lives in Lisbon.", [("name", "Ottoline Fairweather"), ("name", "Lisbon")]),
    ],
)  # fmt: skip
def test_extraction_keeps_each_kind_verbatim(text: str, expected: list[tuple[str, str]]) -> None:
    assert facts(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Sure! Here is what I think about it. It is good and I like it.",  # openers, pronouns
        "Notes from the archive, part 12: Bridge tide records almanac. Mill delta seals winter.",
        "Please remember this, and tell me what you know about it.",  # stop words only
        "I have 2 questions about step 3.",  # short bare counts of the conversation itself
    ],
)
def test_extraction_leaves_out_stop_words_and_sentence_openers(text: str) -> None:
    assert facts(text) == []


def test_assistant_filler_is_never_extracted() -> None:
    assert facts("Certainly! Your cat Pixel lives at /home/ada with code 4817.", role="assistant") == []


def test_tool_results_are_read_inside_their_wrapper_and_json() -> None:
    payload = '{"name": "read_file", "content": "port 8080 in server_config.py"}'
    content = f"<tool_response>\n{payload}\n</tool_response>"
    assert facts(content, role="tool") == [("number", "8080"), ("path", "server_config.py")]


def test_a_fact_says_what_it_is_about() -> None:
    pixel = extract_facts(message("My name is Ada and my cat is called Pixel."))[1]
    assert (pixel.cue, pixel.line()) == ("cat", "cat: Pixel")
    assert stem("pet's") == "pet" and "cat" in expand(["pets"])


# -- compaction with a scripted model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def scripted_chat(
    tokenizer: Any, tmp_path: Path, turns: list[str], *, budget: int = 1200, **options: Any
) -> tuple[ContextManager, ScriptedBackend]:
    backend = ScriptedBackend(tokenizer, [BAD_SUMMARY] * 20)  # only the summarizer asks it
    manager = ContextManager.create(
        Store(tmp_path / "t.db"), backend, budget=f"{budget}tok", reserve_tokens=64, **options
    )
    for i, text in enumerate(turns):
        manager.add_user(text)
        manager.next_prompt()
        manager.add_assistant(f"Reply {i}.")
    return manager, backend


def test_compact_keeps_the_names_the_summary_lost(tokenizer: Any, tmp_path: Path) -> None:
    manager, _ = scripted_chat(tokenizer, tmp_path, ISSUE_CHAT, recall=False)
    event = manager.compact("keep the names")
    assert event is not None and event.ledger

    manager.add_user("What are my name and my cat's name?")
    prompt = manager.next_prompt()
    summary = next(m["content"] for m in prompt.messages if m["content"].startswith(SUMMARY_HEADER))
    assert BAD_SUMMARY in summary and f"{LEDGER_HEADER}\n- name: Ada\n- cat: Pixel" in summary
    assert prompt.sections["summary"] <= int(manager.budget.tokens * manager.budget.summary_share)
    assert prompt.sections["recalled"] == 0  # recall is off: the names come from the summary

    (record,) = manager.store.compactions(manager.session_id)
    assert [f["text"] for f in record.ledger] == ["Ada", "Pixel", "Europe"] and record.num_facts_kept == 3
    stored = manager.store.get_summary(record.summary_id or 0).text
    assert stored.endswith("- rivers: Europe") and prose_of(stored) == BAD_SUMMARY
    assert event.describe().endswith("kept 3 facts verbatim")


def test_a_fact_the_summary_states_is_not_repeated(tokenizer: Any, tmp_path: Path) -> None:
    backend = ScriptedBackend(tokenizer, ["Hi Ada.", "Noted.", "The user is Ada."])
    manager = ContextManager.create(Store(tmp_path / "t.db"), backend, budget="1200tok", reserve_tokens=64)
    for text in ("My name is Ada.", "My cat is called Pixel."):
        manager.add_user(text)
        manager.next_prompt()
        manager.add_assistant(backend.replies.pop(0))
    event = manager.compact()
    assert event is not None
    assert manager.summary == f"The user is Ada.\n\n{LEDGER_HEADER}\n- cat: Pixel"
    assert [f["text"] for f in event.ledger] == ["Pixel"]


def test_the_list_stays_in_its_share_folding_the_oldest_facts(tokenizer: Any, tmp_path: Path) -> None:
    turns = [f"Locker number {i} has code {4000 + i} and belongs to Person{chr(65 + i)}." for i in range(20)]
    manager, _ = scripted_chat(tokenizer, tmp_path, turns, budget=600, recall=False)
    event = manager.compact()
    assert event is not None and event.num_facts_folded > 0
    kept = [f["text"] for f in event.ledger]
    assert "4019" in kept and "4000" not in kept  # the newest stay, the oldest fold first
    cap = int(manager.budget.tokens * manager.budget.summary_share)
    assert event.summary_tokens <= cap
    manager.add_user("Next?")
    assert manager.next_prompt().sections["summary"] <= cap


def test_question_sharing_no_word_reaches_the_turn_through_the_ledger(tokenizer: Any, tmp_path: Path) -> None:
    question = "Which animal lives with me, and what do I call it?"
    fact = "My cat is called Pixel."
    assert not set(question.lower().split()) & set(fact.lower().split())
    for ledger_recall, found in ((False, False), (True, True)):
        manager, _ = scripted_chat(tokenizer, tmp_path / str(ledger_recall), [fact, *ISSUE_CHAT[1:]],
                                   ledger_recall=ledger_recall)  # fmt: skip
        assert manager.compact() is not None
        manager.add_user(question)
        prompt = manager.next_prompt()
        assert ([h.content for h in prompt.recalled] == [fact]) is found
        assert any(fact in m["content"] and "Recalled" in m["content"] for m in prompt.messages) is found


# -- the issue's chat on the real default model -----------------------------------------------


@pytest.mark.model
def test_issue_chat_on_the_default_model_keeps_the_names(default_model_path: Path, tmp_path: Path) -> None:
    """``liubai chat --kv-budget 1200tok``, scripted: six turns, ``/compact keep the names``, then
    a question; with recall off, the names are in the prompt through the kept-verbatim list,
    whatever the 135M model wrote as its summary."""
    from runtime import Engine, SamplingParams
    from runtime.backends.backend import LocalBackend

    backend = LocalBackend(Engine(model=str(default_model_path), kv_pool="64MiB"))
    manager = ContextManager.create(
        Store(tmp_path / "t.db"), backend, budget="1200tok", reserve_tokens=64, recall=False
    )
    share = int(manager.budget.tokens * manager.budget.summary_share)
    for text in ISSUE_CHAT:
        manager.add_user(text)
        prompt = manager.next_prompt()
        assert prompt.sections["summary"] <= share
        reply = "".join(d.text for d in backend.stream(prompt.chat_prompt(), SamplingParams(max_tokens=16)))
        manager.add_assistant(reply)
    event = manager.compact("keep the names")
    assert event is not None and {"Ada", "Pixel"} <= {f["text"] for f in event.ledger} | {
        w for w in ("Ada", "Pixel") if w in (manager.summary or "")
    }

    manager.add_user("What is my pet's name?")
    prompt = manager.next_prompt()
    assert prompt.sections["summary"] <= share and prompt.sections["recalled"] == 0
    text = "\n".join(m["content"] for m in prompt.messages)
    assert "Ada" in text and "Pixel" in text
    assert all(m.state == "summarized" for m in manager.messages() if m.turn <= len(ISSUE_CHAT))
