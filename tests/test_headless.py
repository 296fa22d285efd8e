"""Headless runs end to end on the real default model: JSON results, the database, scripts, -j."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.config import AgentConfig
from agent.headless.runner import HeadlessRun, run_headless
from memory.store import Store
from runtime import Engine
from runtime.backends.backend import LocalBackend

REPO = Path(__file__).resolve().parent.parent
SCRIPT_TURNS = [
    "My name is Ada Lovelace and I live in London with my cat Pomelo.",
    "What is my name?",
]


def liubai(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "liubai"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
        env={**os.environ, **(env or {})},
    )


def write_script(path: Path, turns: list[str]) -> Path:
    path.write_text("".join(json.dumps({"user": t}) + "\n" for t in turns))
    return path


@pytest.fixture(scope="module")
def backend(default_model_path: Path) -> LocalBackend:
    return LocalBackend(
        # float32 named: the fields below (KV dtype, bytes, weights, speculation) are its figures.
        Engine(model=str(default_model_path), kv_pool="256MiB", dtype="float32"),
        model_name="smollm2-135m-instruct",
    )


def run_json(
    backend: LocalBackend, config: AgentConfig, run: HeadlessRun
) -> tuple[int, list[dict[str, Any]]]:
    out, err = io.StringIO(), io.StringIO()
    code = run_headless(config, run, out, err, backend=backend)
    return code, [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.model
def test_script_json_fields_and_database_rows(backend: LocalBackend, tmp_path: Path) -> None:
    config = AgentConfig(db=str(tmp_path / "t.db"), max_tokens=12, tools=False, kv_budget="2048tok")
    script = write_script(tmp_path / "s.jsonl", SCRIPT_TURNS)
    code, [result] = run_json(backend, config, HeadlessRun(scripts=[str(script)], output="json"))

    assert code == 0 and result["is_error"] is False and result["error"] is None
    for key in ("answer", "session_id", "usage", "timings", "kv", "compactions", "cost"):
        assert key in result
    first, second = result["turns"]
    assert second["usage"]["cached_tokens"] > 0  # turn 2 reuses turn 1's prefix
    for turn in (first, second):
        u = turn["usage"]
        assert u["prefilled_tokens"] == u["prompt_tokens"] - u["cached_tokens"]
        assert 0 < u["generated_tokens"] <= 12
        assert turn["kv"]["tokens"] == u["prompt_tokens"] + u["generated_tokens"]
        assert turn["kv"]["bytes"] == turn["kv"]["tokens"] * backend.bytes_per_token
    assert result["answer"] == second["answer"]
    assert (
        result["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    )
    assert result["kv"]["budget_tokens"] == 2048
    assert result["kv"]["budget_bytes"] == 2048 * backend.bytes_per_token
    assert result["kv"]["k_dtype"] == "float32" and result["timings"]["ttft_ms"] > 0
    assert result["kv"]["weights"] == "float32" and result["kv"]["compiled"] is False
    # --speculate auto is prompt lookup with float32 weights; the counters add up.
    timings = result["timings"]
    assert result["kv"]["speculate"] == "ngram"
    assert 0 <= timings["num_accepted_tokens"] <= timings["num_draft_tokens"]
    if timings["num_drafts"] == 0:
        assert timings["acceptance_rate"] == 0 and timings["mean_accepted_length"] == 0

    store = Store(config.db)
    rows = store.requests(result["session_id"])
    assert [r["prompt_tokens"] for r in rows] == [t["usage"]["prompt_tokens"] for t in result["turns"]]
    assert [r["cached_tokens"] for r in rows] == [t["usage"]["cached_tokens"] for t in result["turns"]]
    assert [r["generated_tokens"] for r in rows] == [t["usage"]["generated_tokens"] for t in result["turns"]]
    assert sum(r["compute_s"] for r in rows) == pytest.approx(result["cost"]["compute_s"], abs=1e-5)
    assert [(r["weights"], r["compiled"]) for r in rows] == [("float32", 0)] * len(rows)  # m006
    messages = store.messages(result["session_id"])
    assert [m.content for m in messages if m.role == "user"] == SCRIPT_TURNS
    assert [m.content for m in messages if m.role == "assistant"] == [t["answer"] for t in result["turns"]]


@pytest.mark.model
def test_four_scripts_concurrently_equal_each_alone(backend: LocalBackend, tmp_path: Path) -> None:
    config = AgentConfig(db=str(tmp_path / "t.db"), max_tokens=10, tools=False)
    scripts = [
        str(
            write_script(
                tmp_path / f"s{i}.jsonl",
                [f"Give me a fruit that starts with the letter {c}.", "Another one?"],
            )
        )
        for i, c in enumerate("ABCP")
    ]
    alone = [run_json(backend, config, HeadlessRun(scripts=[s], output="json"))[1][0] for s in scripts]
    before = backend.stats().max_batch_size
    code, together = run_json(backend, config, HeadlessRun(scripts=scripts, output="json", jobs=4))

    assert code == 0
    assert [[t["answer"] for t in r["turns"]] for r in together] == [
        [t["answer"] for t in r["turns"]] for r in alone
    ]
    assert backend.stats().max_batch_size > max(1, before)


@pytest.mark.model
def test_session_resume_continues_the_conversation(backend: LocalBackend, tmp_path: Path) -> None:
    config = AgentConfig(db=str(tmp_path / "t.db"), max_tokens=8, tools=False)
    _, [first] = run_json(backend, config, HeadlessRun(prompt="My name is Ada.", output="json"))
    _, [second] = run_json(
        backend, config, HeadlessRun(prompt="What is my name?", session_id=first["session_id"], output="json")
    )
    assert second["session_id"] == first["session_id"]
    assert second["turns"][0]["turn"] == 2 and second["usage"]["cached_tokens"] > 0
    roles = [m.role for m in Store(config.db).messages(first["session_id"])]
    assert roles == ["user", "assistant", "user", "assistant"]


@pytest.mark.model
def test_jsonl_streams_events_then_the_result(backend: LocalBackend, tmp_path: Path) -> None:
    config = AgentConfig(db=str(tmp_path / "t.db"), max_tokens=6, tools=False)
    out = io.StringIO()
    assert (
        run_headless(config, HeadlessRun(prompt="Say hello.", output="jsonl"), out, io.StringIO(), backend)
        == 0
    )
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    types = [r["type"] for r in records]
    assert types[0] == "turn_start" and "token" in types and types[-2:] == ["turn_end", "result"]
    answer = "".join(r["text"] for r in records if r["type"] == "token")
    assert answer.strip() == records[-1]["answer"].strip()
    # The last line is the object --json prints.
    assert set(records[-1]) >= {"answer", "session_id", "is_error", "usage", "timings", "kv", "cost"}


REPEAT_PROMPT = (
    "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, "
    "grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya."
)


@pytest.mark.model
def test_speculate_ngram_reports_its_guesses_in_json_and_the_database(
    default_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``liubai run --speculate ngram --json``: the engine guesses from the prompt (a list to
    repeat, where prompt lookup pays), and what it guessed and accepted reaches ``timings``, the
    engine's mode ``kv.speculate``, and each request's row in the store."""
    from agent.cli import main as cli

    db = tmp_path / "t.db"
    args = ["run", "--json", "--speculate", "ngram", "--num-draft-tokens", "4", "--kv-pool", "64MiB"]
    code = cli.main(
        [*args, "--kv-disk", "0", "--max-tokens", "40", "--no-tools", "--db", str(db), REPEAT_PROMPT]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    t = result["timings"]
    assert result["kv"]["speculate"] == "ngram"
    assert (
        t["num_drafts"] > 0 and 0 < t["num_accepted_tokens"] <= t["num_draft_tokens"] <= 4 * t["num_drafts"]
    )
    assert t["acceptance_rate"] == pytest.approx(t["num_accepted_tokens"] / t["num_draft_tokens"], abs=1e-4)
    assert t["mean_accepted_length"] == pytest.approx(
        1 + t["num_accepted_tokens"] / t["num_drafts"], abs=1e-3
    )
    assert result["turns"][0]["timings"]["num_drafts"] == t["num_drafts"]
    (row,) = Store(db).requests(result["session_id"])
    assert (row["num_drafts"], row["num_draft_tokens"], row["num_accepted_tokens"]) == (
        t["num_drafts"],
        t["num_draft_tokens"],
        t["num_accepted_tokens"],
    )


def test_timing_line_says_what_speculation_accepted(tmp_path: Path, default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.scripted_backend import ScriptedBackend

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    lines = []
    for drafts in (None, (2, 8, 5)):
        err = io.StringIO()
        backend = ScriptedBackend(tokenizer, ["Apple, banana, cherry."], drafts=drafts)
        config = AgentConfig(db=str(tmp_path / "t.db"), tools=False)
        assert run_headless(config, HeadlessRun(prompt="List fruit."), io.StringIO(), err, backend) == 0  # type: ignore[arg-type]
        lines.append(err.getvalue().strip())
    plain, speculated = lines
    assert "tok/s) ·" in plain and "accepted" not in plain
    assert "tok/s, accepted 3.5) ·" in speculated


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (["--model", "/nonexistent/model", "hi"], 1, "/nonexistent/model"),
        (["--script", "{bad}"], 2, "script not found"),
        (["--kv-budget", "10tok", "hi"], 1, "smaller than the system prompt"),
        (["--session", "nosuchsession", "hi"], 1, "no session 'nosuchsession'"),
        (["--db", "/proc/liubai/t.db", "hi"], 1, "/proc/liubai"),
        (["--kv-budget", "lots", "hi"], 2, "not a KV budget"),
        ([], 2, "give a prompt or --script"),
    ],
)
def test_bad_input_is_one_line_and_the_right_exit_code(
    args: list[str], code: int, fragment: str, tmp_path: Path, default_model_path: Path
) -> None:
    args = [a.replace("{bad}", str(tmp_path / "missing.jsonl")) for a in args]
    if "--db" not in args:
        args = ["--db", str(tmp_path / "t.db"), *args]
    result = liubai("run", "--max-tokens", "4", *args)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liubai: error: "), result.stderr
    assert fragment in lines[0] and "Traceback" not in result.stderr


def test_malformed_script_names_the_line(tmp_path: Path) -> None:
    script = tmp_path / "bad.jsonl"
    script.write_text('{"user": "hi"}\n{"pin": "two"}\n')
    result = liubai("run", "--db", str(tmp_path / "t.db"), "--script", str(script))
    assert result.returncode == 2
    assert f"{script}:2" in result.stderr and "Traceback" not in result.stderr


def _as_in_a_terminal() -> None:
    """Ctrl-C's signal at its default in the child, as a terminal's foreground job has it: a test
    run started in the background by a shell without job control inherits SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.model
def test_sigint_mid_reply_exits_130_and_stores_the_partial_reply(
    tmp_path: Path, default_model_path: Path
) -> None:
    db = tmp_path / "t.db"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "liubai"), "run", "--db", str(db), "--no-tools",
         "--max-tokens", "400", "--kv-budget", "2048tok",
         "Write a very long story about a lighthouse keeper."],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        preexec_fn=_as_in_a_terminal,
    )  # fmt: skip
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    seen = ""
    deadline = time.monotonic() + 240
    while len(seen) < 40 and time.monotonic() < deadline and proc.poll() is None:
        try:
            seen += os.read(proc.stdout.fileno(), 4096).decode(errors="replace")
        except BlockingIOError:
            time.sleep(0.05)
    assert len(seen) >= 40, "the reply never started streaming"
    proc.send_signal(signal.SIGINT)
    _, stderr_bytes = proc.communicate(timeout=60)
    stderr = stderr_bytes.decode()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr

    store = Store(db)
    (session,) = store.list_sessions()
    messages = store.messages(session.id)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].interrupted and messages[1].content
    assert messages[1].content.startswith(seen.strip()[:20])
    (request,) = store.requests(session.id)
    assert request["interrupted"] == 1 and 0 < request["generated_tokens"] < 400


@pytest.mark.model
def test_tools_auto_on_the_default_model_sends_a_short_prompt(backend: LocalBackend, tmp_path: Path) -> None:
    """The default model does not call tools: ``auto`` leaves their schemas out, and ``--json``
    says so; ``on`` sends them as before."""
    prompt_tokens = {}
    for setting in ("auto", "on"):
        config = AgentConfig(db=str(tmp_path / f"{setting}.db"), max_tokens=4, tools=setting)
        code, [result] = run_json(backend, config, HeadlessRun(prompt="Tell me about rivers.", output="json"))
        assert code == 0 and result["tools"]["setting"] == setting
        assert result["tools"]["enabled"] is (setting == "on")
        prompt_tokens[setting] = result["usage"]["prompt_tokens"]
    assert prompt_tokens["auto"] < 60 < 400 < prompt_tokens["on"]
