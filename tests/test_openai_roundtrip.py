"""The agent over HTTP: the OpenAI backend against ``liubai serve`` gives the local engine's answers.

Real HTTP on loopback, the real default model, one engine behind both paths: the same headless
script runs once through the local backend and once through the OpenAI-compatible client talking
to ``liubai serve``, and (greedy) every turn's answer is the same.
"""

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.config import AgentConfig
from agent.headless.runner import HeadlessRun, run_headless
from runtime import Engine
from runtime.backends.backend import Backend, LocalBackend
from runtime.backends.openai_backend import OpenAIBackend
from runtime.serve.server import OpenAIServer

MODEL = "smollm2-135m-instruct"
TURNS = [
    "My name is Ada and I keep bees in Lyon.",
    "How many legs does a bee have?",
    "What is my name?",
]

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Engine:
    # float32 by name: the second script's prompts hit the first's prefix cache, so its prefill
    # runs in other chunk shapes, and in bfloat16 or int4 (what `auto` picks on most CPUs) a
    # product of another row count can round a near-tie the other way. float32 keeps them equal.
    return Engine(model=str(default_model_path), kv_pool="128MiB", weights="float32", dtype="float32")


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[OpenAIServer]:
    with OpenAIServer(engine, MODEL, port=0) as running:
        yield running


def run_script(backend: Backend, tmp_path: Path, name: str) -> dict[str, Any]:
    script = tmp_path / f"{name}.jsonl"
    script.write_text("".join(json.dumps({"user": t}) + "\n" for t in TURNS))
    config = AgentConfig(
        model=MODEL, db=str(tmp_path / f"{name}.db"), max_tokens=16, tools=False, kv_budget="4096tok"
    )
    out = io.StringIO()
    code = run_headless(
        config, HeadlessRun(scripts=[str(script)], output="json"), out, io.StringIO(), backend
    )
    assert code == 0, out.getvalue()
    result: dict[str, Any] = json.loads(out.getvalue())
    return result


def test_same_answers_through_both_backends(
    engine: Engine, server: OpenAIServer, default_model_path: Path, tmp_path: Path
) -> None:
    local = run_script(LocalBackend(engine, model_name=MODEL), tmp_path, "local")
    remote_backend = OpenAIBackend(server.url, MODEL, tokenizer_path=default_model_path)
    remote = run_script(remote_backend, tmp_path, "remote")
    # The server's model card tells the client the context its budgets are capped at.
    assert remote_backend.max_context_tokens == engine.max_model_len == 8192

    assert [t["answer"] for t in remote["turns"]] == [t["answer"] for t in local["turns"]]
    # The server reports its prefix cache: turn 2 reuses turn 1's prompt.
    assert remote["turns"][1]["usage"]["cached_tokens"] > 0
    assert [t["usage"]["prompt_tokens"] for t in remote["turns"]] == [
        t["usage"]["prompt_tokens"] for t in local["turns"]
    ]
    # Bytes are unknown behind an HTTP API: the budget is in tokens and bytes are reported as unknown.
    assert remote["kv"]["budget_tokens"] == 4096
    assert remote["kv"]["bytes"] is None and remote["kv"]["budget_bytes"] is None
    assert remote["kv"]["k_dtype"] is None and remote["kv"]["weights"] is None
    assert remote["kv"]["compiled"] is None and remote["kv"]["speculate"] is None


def test_remote_model_without_a_local_tokenizer_is_counted_and_labelled(
    engine: Engine, server: OpenAIServer, tmp_path: Path
) -> None:
    """An OpenAI-family name and no tokenizer: tiktoken counts (or an estimate, if its files are
    absent), the session records which, and the answers still equal the local engine's."""
    from memory.store import Store

    with OpenAIServer(engine, "gpt-4o-mini", port=0) as renamed:
        remote = run_script(OpenAIBackend(renamed.url, "gpt-4o-mini"), tmp_path, "tiktoken")
    local = run_script(LocalBackend(engine, model_name=MODEL), tmp_path, "local")

    assert [t["answer"] for t in remote["turns"]] == [t["answer"] for t in local["turns"]]
    store = Store(tmp_path / "tiktoken.db")
    session = store.get_session(remote["session_id"])
    assert session.token_source in ("tiktoken", "estimate") and session.budget_tokens == 4096
    assert {r["token_source"] for r in store.requests(session.id)} == {"server"}
