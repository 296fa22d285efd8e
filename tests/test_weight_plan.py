"""``weights="auto"``: the fastest format measured on this machine within the quality bound, kept on disk."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import Engine
from runtime.engine.weight_plan import CANDIDATES, FormatFigures, choose, plan_dir, plan_path


def _row(fmt: str, tok_s: float, kld: float = 0.0, top1: float = 1.0) -> FormatFigures:
    return FormatFigures(fmt, tok_s, kld, top1, 0.0)


def test_the_choice_is_the_fastest_format_within_the_bounds() -> None:
    rows = [
        _row("float32", 30),
        _row("bfloat16", 28, 9e-4, 0.97),
        _row("int8", 47, 3e-3),
        _row("int4", 64, 3e-4),
    ]
    assert choose(rows) == "int4"
    # bfloat16 misses top-1 >= 0.98 and int8 KLD <= 1e-3: however fast, neither is picked.
    assert (
        choose([_row("float32", 30), _row("bfloat16", 90, 9e-4, 0.97), _row("int8", 95, 3e-3)]) == "float32"
    )
    assert choose([_row("float32", 30), _row("int4", 25, 3e-4)]) == "float32"


def test_a_less_precise_format_must_be_clearly_faster() -> None:
    """Within 5% the more precise format stays: equal speeds must not be decided by noise."""
    assert choose([_row("float32", 30), _row("bfloat16", 31)]) == "float32"
    assert choose([_row("float32", 30), _row("bfloat16", 32)]) == "bfloat16"
    # Each step is against the current choice: int4 within 5% of int8 keeps int8.
    assert choose([_row("float32", 30), _row("int8", 60), _row("int4", 62, 3e-4)]) == "int8"
    assert choose([_row("int4", 62, 3e-4), _row("float32", 30), _row("int8", 60)]) == "int8"  # any order
    assert choose([_row("float32", 30), _row("int8", 60), _row("int4", 64, 3e-4)]) == "int4"


def _plans() -> list[Path]:
    return sorted(plan_dir().glob("*.json"))


def test_a_named_dtype_or_format_is_never_measured(tiny_llama_path: Path) -> None:
    notices: list[str] = []
    before = _plans()
    assert (
        Engine(tiny_llama_path, kv_pool="4MiB", dtype="float32", on_notice=notices.append).weight_format
        == "float32"
    )
    assert (
        Engine(tiny_llama_path, kv_pool="4MiB", dtype="bfloat16", on_notice=notices.append).weight_format
        == "bfloat16"
    )
    assert (
        Engine(tiny_llama_path, kv_pool="4MiB", weights="int8", on_notice=notices.append).weight_format
        == "int8"
    )
    assert notices == [] and _plans() == before


def test_auto_measures_once_and_reads_the_plan_back(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIUBAI_WEIGHT_PLAN_DIR", str(tmp_path))
    notices: list[str] = []
    first = Engine(tiny_llama_path, kv_pool="4MiB", device="cpu", on_notice=notices.append)
    plan = plan_path(tiny_llama_path)
    assert _plans() == [plan]
    data = json.loads(plan.read_text())
    assert [row["format"] for row in data["rows"]] == list(CANDIDATES)
    assert data["choice"] == choose([FormatFigures(**row) for row in data["rows"]]) == first.weight_format
    assert len(notices) == 2 and notices[1].startswith(f"weights auto: {first.weight_format} (")

    notices.clear()
    second = Engine(tiny_llama_path, kv_pool="4MiB", device="cpu", on_notice=notices.append)
    assert second.weight_format == first.weight_format and notices == []

    # A kept plan whose eligible format was never timed (a bound since loosened) is measured again.
    data["rows"][0]["decode_tok_s"] = None
    plan.write_text(json.dumps(data))
    Engine(tiny_llama_path, kv_pool="4MiB", device="cpu", on_notice=notices.append)
    assert len(notices) == 2 and json.loads(plan.read_text())["rows"][0]["decode_tok_s"] is not None

    notices.clear()
    plan.write_text("{not json")  # a damaged plan is measured again and replaced
    third = Engine(tiny_llama_path, kv_pool="4MiB", device="cpu", on_notice=notices.append)
    assert len(notices) == 2 and json.loads(plan.read_text())["choice"] == third.weight_format


@pytest.mark.model
def test_auto_on_the_default_model_keeps_its_quality(default_model_path: Path, tmp_path: Path) -> None:
    """On the real model the choice meets KLD <= 1e-3 and top-1 >= 0.98 against float32 weights,
    and the engine runs it (whatever this CPU measured fastest)."""
    engine = Engine(default_model_path, kv_pool="32MiB", device="cpu", on_notice=lambda _line: None)
    data = json.loads(plan_path(default_model_path).read_text())
    assert data["choice"] == engine.weight_format
    rows = {row["format"]: FormatFigures(**row) for row in data["rows"]}
    chosen = rows[engine.weight_format]
    assert chosen.format == "float32" or chosen.within_bounds
    assert all(row.rate <= chosen.rate for row in rows.values() if row.within_bounds)
    # Only what the rule may pick was timed: a format out of the bounds is scored, never timed.
    assert all((row.decode_tok_s is not None) == row.eligible for row in rows.values())
    assert engine.stats().weight_format == engine.weight_format
    completion = engine.generate("The capital of France is")[0]
    assert completion.token_ids and completion.finish_reason in ("stop", "length")

    # The CLI's default is the same plan, read back (no second measurement, no notice about it).
    cli = Path(sys.executable).parent / "liubai"
    args = [
        str(cli),
        "run",
        "--json",
        "--no-tools",
        "--max-tokens",
        "8",
        "--db",
        str(tmp_path / "t.db"),
        "Hi",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["kv"]["weights"] == engine.weight_format
    assert "weights auto" not in proc.stderr
