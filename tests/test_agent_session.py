"""The agent loop with a scripted model stand-in: tool rounds, permissions, events, store rows.

The stand-in replays fixed replies (so what the "model" says is known), but everything else is
real: the context manager, the store, the tool registry and the SmolLM2 tokenizer.
"""

import threading
from pathlib import Path
from typing import Any

import pytest

from agent.config import AgentConfig
from agent.events import Event, TokenDelta, ToolCalled, ToolFinished, TurnFinished, TurnStarted
from agent.session import AgentSession, TurnInterrupted
from memory.store import Store
from tests.scripted_backend import ScriptedBackend


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def open_session(tmp_path: Path, backend: ScriptedBackend, **options: Any) -> AgentSession:
    """A session on the stand-in; its tools are on unless a test says otherwise (``auto`` would
    leave them off: the stand-in has SmolLM2's chat template, which renders no tools)."""
    options.setdefault("tools", "on")
    config = AgentConfig(db=str(tmp_path / "t.db"), workdir=tmp_path, max_tokens=64, **options)
    return AgentSession.open(backend, Store(config.db), config)  # type: ignore[arg-type]


def test_plain_turn_events_and_rows(tmp_path: Path, tokenizer: Any) -> None:
    backend = ScriptedBackend(tokenizer, ["Paris is the capital."])
    session = open_session(tmp_path, backend, tools=False, price_per_hour=3.6)
    events: list[Event] = []
    result = session.run_turn("Capital of France?", events.append)

    assert result.answer == "Paris is the capital."
    assert [type(e) for e in events][0] is TurnStarted
    assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == result.answer
    finished = [e for e in events if isinstance(e, TurnFinished)]
    assert len(finished) == 1 and finished[0].usage["prompt_tokens"] == len(
        backend.prompts[0].token_ids or []
    )
    # 3.6 $/h for 30 ms of compute
    assert finished[0].cost["usd"] == pytest.approx(3.6 * 0.030 / 3600)

    rows = session.store.requests(session.session_id)
    assert (
        len(rows) == 1
        and rows[0]["kind"] == "turn"
        and rows[0]["prompt_tokens"] == result.usage()["prompt_tokens"]
    )
    assert rows[0]["cost_usd"] == pytest.approx(3.6 * 0.030 / 3600)
    stored = [(m.role, m.content) for m in session.store.messages(session.session_id)]
    assert stored == [("user", "Capital of France?"), ("assistant", "Paris is the capital.")]


def test_tool_round_reads_a_file_and_feeds_the_result_back(tmp_path: Path, tokenizer: Any) -> None:
    (tmp_path / "notes.txt").write_text("the secret word is marmalade\n")
    call = '<tool_call>{"name": "read_file", "arguments": {"path": "notes.txt"}}</tool_call>'
    backend = ScriptedBackend(tokenizer, [f"Let me look. {call}", "The word is marmalade."])
    session = open_session(tmp_path, backend)
    events: list[Event] = []
    result = session.run_turn("What is the secret word in notes.txt?", events.append)

    assert result.answer == "The word is marmalade." and result.num_tool_rounds == 1
    shown = "".join(e.text for e in events if isinstance(e, TokenDelta))
    assert "<tool_call>" not in shown  # markup never reaches the user
    assert any(isinstance(e, ToolCalled) and e.name == "read_file" for e in events)
    second_prompt = backend.prompts[1].messages
    assert second_prompt[-1]["role"] == "tool" and "marmalade" in second_prompt[-1]["content"]
    kinds = [r["kind"] for r in session.store.requests(session.session_id)]
    assert kinds == ["turn", "tool"]


def test_shell_is_refused_without_allow_tools(tmp_path: Path, tokenizer: Any) -> None:
    marker = tmp_path / "ran"
    call = '<tool_call>{"name": "shell", "arguments": {"command": "touch ran"}}</tool_call>'
    backend = ScriptedBackend(tokenizer, [call, "I may not run commands."])
    session = open_session(tmp_path, backend)
    events: list[Event] = []
    session.run_turn("Run touch ran", events.append)

    assert not marker.exists()
    refused = [e for e in events if isinstance(e, ToolFinished)]
    assert refused and refused[0].refused and not refused[0].ok
    assert "refused" in (backend.prompts[1].messages[-1]["content"])


def test_shell_runs_when_allowed(tmp_path: Path, tokenizer: Any) -> None:
    call = '<tool_call>{"name": "shell", "arguments": {"command": "touch ran && echo done"}}</tool_call>'
    backend = ScriptedBackend(tokenizer, [call, "Done."])
    session = open_session(tmp_path, backend, allow_tools="shell")
    session.run_turn("Run it")
    assert (tmp_path / "ran").exists()
    assert "done" in (backend.prompts[1].messages[-1]["content"])


def test_tool_rounds_are_limited(tmp_path: Path, tokenizer: Any) -> None:
    call = '<tool_call>{"name": "list_dir", "arguments": {"path": "."}}</tool_call>'
    backend = ScriptedBackend(tokenizer, [call] * 3)
    session = open_session(tmp_path, backend, max_tool_rounds=2)
    result = session.run_turn("Loop forever")
    assert result.num_tool_rounds == 2 and len(backend.prompts) == 3


def test_cancel_stores_the_partial_reply_marked(tmp_path: Path, tokenizer: Any) -> None:
    gate = threading.Event()
    backend = ScriptedBackend(tokenizer, ["one two three four five six seven"], gate=gate)
    session = open_session(tmp_path, backend, tools=False)
    cancel = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, TokenDelta):
            cancel.set()
            gate.set()

    with pytest.raises(TurnInterrupted) as info:
        session.run_turn("Count", on_event, cancel)
    assert info.value.result.interrupted
    last = session.store.messages(session.session_id)[-1]
    assert last.role == "assistant" and last.interrupted
    assert last.content and "seven" not in last.content


def test_recall_tool_searches_the_session(tmp_path: Path, tokenizer: Any) -> None:
    call = '<tool_call>{"name": "recall", "arguments": {"query": "wifi password"}}</tool_call>'
    backend = ScriptedBackend(tokenizer, ["Noted.", call, "It is tangerine-7741."])
    session = open_session(tmp_path, backend)
    session.run_turn("Our wifi password is tangerine-7741.")
    session.run_turn("What was the wifi password?")
    assert "tangerine-7741" in backend.prompts[2].messages[-1]["content"]


def test_tools_auto_leaves_the_schemas_out_for_a_model_that_does_not_call_tools(
    tmp_path: Path, tokenizer: Any
) -> None:
    """SmolLM2's template renders no tools, so ``auto`` leaves them out; ``on`` puts them in."""
    prompts = {}
    for setting in ("auto", "on", "off"):
        backend = ScriptedBackend(tokenizer, ["Rivers flow."])
        (tmp_path / setting).mkdir()
        session = open_session(tmp_path / setting, backend, tools=setting)
        session.run_turn("Tell me about rivers in Europe.")
        prompts[setting] = backend.prompts[0]
        assert session.tools_decision.enabled is (setting == "on")
    system = {setting: prompt.messages[0]["content"] for setting, prompt in prompts.items()}
    assert "list_dir" in system["on"] and "<tools>" in system["on"]
    assert system["auto"] == system["off"] == "You are a helpful assistant."
    assert len(prompts["auto"].token_ids or []) < 60 < len(prompts["on"].token_ids or [])


def test_tools_auto_offers_tools_to_remote_backends_and_tool_templates(
    tmp_path: Path, tokenizer: Any
) -> None:
    from agent.tools.availability import decide_tools

    assert decide_tools("auto", "openai", "gpt-4o-mini", None).enabled
    qwen_like = type("Tokenizer", (), {"chat_template": "{% if tools %}<tools>{% endif %}"})()
    assert decide_tools("auto", "local", "my-qwen", qwen_like).enabled
    decision = decide_tools("auto", "local", "smollm2-135m-instruct", tokenizer)
    assert not decision.enabled and "registry" in decision.reason
