"""The `liubai` command: help, exit codes, and one-line errors instead of tracebacks.

Most tests run the real console script in a subprocess, since exit codes and what reaches
stderr are the behaviour under test; a few call ``main()`` in-process with the run logic
replaced, to reach paths (Ctrl-C, stdin prompts) a subprocess cannot drive cheaply.
"""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent import cli, oneshot

REPO = Path(__file__).resolve().parent.parent


def liubai(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "liubai"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "agent.cli"]
    return subprocess.run(
        [*command, *args], input=stdin, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
    )


def assert_one_error_line(stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("liubai: error: ")
    assert "Traceback" not in stderr


def test_help() -> None:
    result = liubai("--help")
    assert result.returncode == 0
    assert "run" in result.stdout and "pull" in result.stdout
    run_help = liubai("run", "--help")
    for flag in (
        "--model",
        "--system",
        "--max-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--kv-pool",
        "--dtype",
        "--kv-dtype",
        "--k-dtype",
        "--v-dtype",
        "--json",
    ):
        assert flag in run_help.stdout


def test_missing_model_is_one_line_exit_1() -> None:
    result = liubai("run", "--model", "/nonexistent", "x")
    assert result.returncode == 1
    assert_one_error_line(result.stderr)
    assert "/nonexistent" in result.stderr
    assert result.stdout == ""


def test_missing_model_with_json_prints_error_object() -> None:
    result = liubai("run", "--json", "--model", "/nonexistent", "x")
    assert result.returncode == 1
    assert_one_error_line(result.stderr)
    payload = json.loads(result.stdout)
    assert payload["is_error"] is True and "/nonexistent" in payload["error"]


def test_unknown_flag_exits_2() -> None:
    result = liubai("run", "--no-such-flag", "x")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--kv-pool", "lots"], "not a size"),
    ],
)
def test_bad_values_are_usage_errors(flags: list[str], fragment: str) -> None:
    result = liubai("run", *flags, "x")
    assert result.returncode == 2
    assert_one_error_line(result.stderr)
    assert fragment in result.stderr


def test_kv_dtype_flags_reach_the_run_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.kv_quant import KV_DTYPES

    assert oneshot.KV_DTYPES == KV_DTYPES
    seen: list[oneshot.RunOptions] = []
    monkeypatch.setattr(oneshot, "run_oneshot", lambda options: seen.append(options))
    assert cli.main(["run", "hi", "--kv-dtype", "int8", "--v-dtype", "int4"]) == 0
    assert (seen[0].kv_dtype, seen[0].k_dtype, seen[0].v_dtype) == ("int8", None, "int4")
    bad = liubai("run", "--kv-dtype", "int3", "x")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_dash_reads_prompt_from_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[oneshot.RunOptions] = []
    monkeypatch.setattr(oneshot, "run_oneshot", lambda options: seen.append(options))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello from stdin\n"))

    assert cli.main(["run", "-", "--system", "be brief", "--seed", "3"]) == 0
    assert seen[0].prompt == "hello from stdin\n"
    assert seen[0].system == "be brief" and seen[0].seed == 3


def test_ctrl_c_exits_130_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(options: oneshot.RunOptions) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(oneshot, "run_oneshot", interrupted)
    assert cli.main(["run", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.model
def test_run_streams_reply_and_timing(default_model_path: Path) -> None:
    result = liubai("run", "--max-tokens", "6", "What is the capital of France?", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tok/s" in result.stderr and "prompt " in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.model
def test_run_json(default_model_path: Path) -> None:
    result = liubai("run", "--json", "--max-tokens", "4", "Say hi", timeout=300)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["is_error"] is False
    assert 0 < payload["usage"]["completion_tokens"] <= 4
    assert payload["answer"] and payload["timings"]["num_prompt_tokens"] > 0
    assert payload["finish_reason"] in ("stop", "length")
