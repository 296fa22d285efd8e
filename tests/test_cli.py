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

from agent.cli import main as cli
from agent.config import AgentConfig
from agent.headless import runner as headless
from agent.headless.runner import HeadlessRun

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
    for command in ("chat", "run", "pull", "plan", "logs", "serve", "kv"):
        assert command in result.stdout
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
        "--kv-disk",
        "--dtype",
        "--kv-dtype",
        "--k-dtype",
        "--v-dtype",
        "--json",
        "--jsonl",
        "--script",
        "--jobs",
        "--session",
        "--kv-budget",
        "--db",
        "--allow-tools",
        "--price-per-hour",
        "--speculate",
        "--draft-model",
        "--num-draft-tokens",
        "--draft-weights",
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
        (["--dtype", "float32", "--weights", "int4"], "bfloat16 activations"),
        (["--dtype", "bfloat16", "--weights", "float32"], "disagree"),
        (["--kv-disk", "lots"], "--kv-disk: not a size"),
        (["--num-draft-tokens", "16"], "--num-draft-tokens must be between 1 and 15"),
        (
            ["--speculate", "ngram", "--draft-model", "other"],
            "--draft-model drafts only with --speculate draft",
        ),
    ],
)
def test_bad_values_are_usage_errors(flags: list[str], fragment: str) -> None:
    result = liubai("run", *flags, "x")
    assert result.returncode == 2
    assert_one_error_line(result.stderr)
    assert fragment in result.stderr


Seen = list[tuple[AgentConfig, HeadlessRun]]


@pytest.fixture
def seen_runs(monkeypatch: pytest.MonkeyPatch) -> Seen:
    seen: Seen = []

    def fake(config: AgentConfig, run: HeadlessRun) -> int:
        seen.append((config, run))
        return 0

    monkeypatch.setattr(headless, "run_headless", fake)
    return seen


def test_weights_flag_reaches_the_config(seen_runs: Seen) -> None:
    from agent.config import WEIGHT_FORMATS as CONFIG_WEIGHT_FORMATS
    from runtime.layers.weights import WEIGHT_FORMATS

    assert CONFIG_WEIGHT_FORMATS == WEIGHT_FORMATS
    assert cli.main(["run", "hi", "--weights", "int4"]) == 0
    assert seen_runs[0][0].weights == "int4"
    bad = liubai("serve", "--dtype", "float32", "--weights", "int8")
    assert bad.returncode == 2
    assert_one_error_line(bad.stderr)


def test_compile_flag_reaches_the_config(seen_runs: Seen) -> None:
    assert cli.main(["run", "hi"]) == 0
    assert cli.main(["run", "hi", "--compile"]) == 0
    assert cli.main(["run", "hi", "--no-compile"]) == 0
    assert [config.compile for config, _run in seen_runs] == [False, True, False]


def test_speculation_flags_reach_the_config(seen_runs: Seen) -> None:
    import dataclasses

    from agent import config as agent_config
    from runtime.engine import config as engine_config
    from runtime.engine import sampling
    from runtime.speculation import drafter

    assert agent_config.SPECULATE_MODES == engine_config.ENGINE_SPECULATE_MODES
    assert agent_config.MAX_NUM_DRAFT_TOKENS == sampling.MAX_NUM_DRAFT_TOKENS
    assert agent_config.DEFAULT_SPECULATE == engine_config.DEFAULT_SPECULATE
    assert agent_config.DEFAULT_NUM_DRAFT_TOKENS == drafter.DEFAULT_NUM_DRAFT_TOKENS
    defaults = {f.name: f.default for f in dataclasses.fields(engine_config.EngineConfig)}
    assert agent_config.DEFAULT_DRAFT_WEIGHTS == defaults["draft_weights"]
    assert cli.main(["run", "hi"]) == 0
    assert cli.main(["run", "hi", "--speculate", "ngram", "--num-draft-tokens", "3"]) == 0
    assert cli.main(["run", "hi", "--draft-model", "my-draft"]) == 0  # implies --speculate draft
    assert cli.main(["run", "hi", "--speculate", "draft", "--draft-weights", "int8"]) == 0
    assert [(c.speculate, c.num_draft_tokens, c.draft_model, c.draft_weights) for c, _run in seen_runs] == [
        ("auto", 5, None, "int4"),
        ("ngram", 3, None, "int4"),
        ("draft", 5, "my-draft", "int4"),
        ("draft", 5, None, "int8"),
    ]
    bad = liubai("run", "--speculate", "maybe", "x")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr and "Traceback" not in bad.stderr


def test_speculation_flags_reach_the_served_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``liubai serve`` hands the flags to the engine, and a draft model the engine refuses is one
    line and exit 1 there too."""
    import agent.backends
    from runtime.errors import DraftModelError

    seen: list[dict[str, object]] = []

    def refuse(model: str, **options: object) -> None:
        seen.append(options)
        raise DraftModelError(
            "the draft model /d has another vocabulary (49153 tokens against the model's 49152)"
        )

    monkeypatch.setattr(agent.backends, "open_engine", refuse)
    assert (
        cli.main(["serve", "--draft-model", "/d", "--num-draft-tokens", "7", "--draft-weights", "auto"]) == 1
    )
    [options] = seen
    assert {k: options[k] for k in ("speculate", "num_draft_tokens", "draft_model", "draft_weights")} == {
        "speculate": "draft",
        "num_draft_tokens": 7,
        "draft_model": "/d",
        "draft_weights": "auto",
    }
    assert_one_error_line(capsys.readouterr().err)
    assert cli.main(["serve", "--speculate", "off", "--draft-model", "/d"]) == 2
    assert "--draft-model drafts only with --speculate draft" in capsys.readouterr().err
    assert len(seen) == 1  # refused before any model loads


@pytest.mark.model
def test_draft_model_errors_are_one_line_exit_1(
    tiny_llama_path: Path, default_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A draft model that is not there, or speaks another vocabulary, fails the run with the CLI's
    one line (a DraftModelError), never a traceback."""
    from transformers import AutoTokenizer

    from tests.tiny_models import make_tiny_model

    other = make_tiny_model("llama", tmp_path / "other-vocab", default_model_path)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["liubai-only-token"])  # one token more than the model's tokenizer
    tokenizer.save_pretrained(other)
    capsys.readouterr()  # (saving the model wrote its progress bar)
    common = ["run", "hi", "--model", str(tiny_llama_path), "--db", str(tmp_path / "t.db"), "--kv-disk", "0"]
    common += ["--weights", "float32"]  # named: measuring --weights auto would add its notices first

    assert cli.main([*common, "--kv-pool", "16MiB", "--draft-model", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert_one_error_line(err)
    assert "--draft-model: unknown model" in err and str(tmp_path / "none") in err
    assert (
        cli.main([*common, "--kv-pool", "16MiB", "--draft-model", str(other), "--draft-weights", "auto"]) == 1
    )
    err = capsys.readouterr().err
    assert_one_error_line(err)
    assert "another vocabulary" in err


def test_kv_dtype_flags_reach_the_config(seen_runs: Seen) -> None:
    from agent.config import KV_DTYPES as CONFIG_KV_DTYPES
    from runtime.kv.quant import KV_DTYPES

    assert CONFIG_KV_DTYPES == KV_DTYPES
    assert cli.main(["run", "hi", "--kv-dtype", "int8", "--v-dtype", "int4", "--kv-budget", "24MiB"]) == 0
    config, _ = seen_runs[0]
    assert (config.kv_dtype, config.k_dtype, config.v_dtype) == ("int8", None, "int4")
    assert config.kv_budget == "24MiB"
    bad = liubai("run", "--kv-dtype", "int3", "x")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_dash_reads_prompt_from_stdin(monkeypatch: pytest.MonkeyPatch, seen_runs: Seen) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello from stdin\n"))

    assert cli.main(["run", "-", "--system", "be brief", "--seed", "3"]) == 0
    config, run = seen_runs[0]
    assert run.prompt == "hello from stdin\n"
    assert config.system == "be brief" and config.seed == 3


def test_script_flags_reach_the_run(seen_runs: Seen) -> None:
    assert cli.main(["run", "--script", "a.jsonl", "--script", "b.toml", "-j", "2", "--jsonl"]) == 0
    _, run = seen_runs[0]
    assert run.scripts == ["a.jsonl", "b.toml"] and run.jobs == 2 and run.output == "jsonl"


def test_ctrl_c_exits_130_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(config: AgentConfig, run: HeadlessRun) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(headless, "run_headless", interrupted)
    assert cli.main(["run", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.model
def test_run_streams_reply_and_timing(default_model_path: Path, tmp_path: Path) -> None:
    result = liubai(
        "run",
        "--db",
        str(tmp_path / "t.db"),
        "--max-tokens",
        "6",
        "What is the capital of France?",
        # The session's first --weights auto on the default model may be this run: it times each
        # format (and the float formats' GEMM plans, in a fresh test cache) before answering.
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tok/s" in result.stderr and "prompt " in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.model
def test_run_json(default_model_path: Path, tmp_path: Path) -> None:
    result = liubai(
        "run", "--db", str(tmp_path / "t.db"), "--json", "--max-tokens", "4", "Say hi", timeout=600
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["is_error"] is False and payload["error"] is None
    assert 0 < payload["usage"]["generated_tokens"] <= 4
    assert payload["answer"] and payload["usage"]["prompt_tokens"] > 0
    assert payload["turns"][0]["finish_reason"] in ("stop", "length")
    assert payload["kv"]["tokens"] == payload["usage"]["prompt_tokens"] + payload["usage"]["generated_tokens"]


@pytest.mark.parametrize(
    ("flags", "setting"),
    [([], "auto"), (["--no-tools"], "off"), (["--tools", "on"], "on"), (["--tools", "off"], "off")],
)
def test_tools_flag_and_its_no_tools_alias(flags: list[str], setting: str) -> None:
    import argparse

    from agent.cli.options import add_agent_options, agent_config

    parser = argparse.ArgumentParser()
    add_agent_options(parser)
    assert agent_config(parser.parse_args(flags)).tools == setting


def test_tools_setting_is_validated() -> None:
    assert AgentConfig(tools=True).tools == "on" and AgentConfig(tools=False).tools == "off"
    with pytest.raises(ValueError, match="--tools must be one of auto, on, off"):
        AgentConfig(tools="sometimes")


@pytest.mark.parametrize(
    "argv", [["--help"], ["run", "--top-p", "5", "hi"], ["logs", "export", "--format", "xml"]]
)
def test_help_and_usage_errors_answer_before_torch_is_imported(argv: list[str]) -> None:
    """Importing torch costs about 2 s; a typo or ``--help`` should not wait for it."""
    probe = (
        "import sys\nfrom agent.cli.main import main\n"
        f"try:\n    code = main({argv!r})\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('torch' in sys.modules, code, file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    imported, code = result.stderr.strip().splitlines()[-1].split()
    assert imported == "False", result.stderr
    assert code == ("0" if argv == ["--help"] else "2")
