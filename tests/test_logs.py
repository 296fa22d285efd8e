"""``liubai logs``: sessions, requests and compactions read back from the store."""

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main as cli
from agent.config import AgentConfig
from agent.session import AgentSession
from memory.store import Store
from tests.scripted_backend import ScriptedBackend


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture
def db(tmp_path: Path, tokenizer: Any) -> Path:
    """Two sessions: two turns at $3.60/h, and one turn unpriced."""
    path = tmp_path / "logs.db"
    config = AgentConfig(db=str(path), tools=False, price_per_hour=3.6)
    session = AgentSession.open(ScriptedBackend(tokenizer, ["One.", "Two."]), Store(path), config)  # type: ignore[arg-type]
    session.run_turn("first")
    session.run_turn("second")
    other = AgentConfig(db=str(path), tools=False)
    AgentSession.open(ScriptedBackend(tokenizer, ["Three."]), Store(path), other).run_turn("third")  # type: ignore[arg-type]
    return path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["logs", *args])
    return code, capsys.readouterr().out


def test_list_sessions_json(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "--db", str(db), "--json")
    assert code == 0
    first, second = json.loads(out)
    assert (first["turns"], first["requests"], second["turns"]) == (2, 2, 1)
    rows = Store(db).requests(first["id"])
    assert first["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert first["compute_s"] == pytest.approx(2 * 0.030)  # 10 ms prefill + 20 ms decode per request
    assert first["cost_usd"] == pytest.approx(3.6 * 0.060 / 3600)
    assert second["cost_usd"] is None and first["ttft_ms_median"] == 12.0


def test_list_sessions_table(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "--db", str(db))
    assert code == 0
    header, *rows = out.splitlines()
    for column in (
        "session",
        "turns",
        "prompt",
        "cached",
        "generated",
        "ttft p50",
        "decode",
        "compute",
        "cost",
    ):
        assert column in header
    assert len(rows) == 2 and "$0.000060" in rows[0]


def test_show_lists_every_request(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sessions = Store(db).list_sessions()
    code, out = run(capsys, "--db", str(db), "show", sessions[0].id, "--json")
    assert code == 0
    payload = json.loads(out)
    assert [r["turn"] for r in payload["requests"]] == [1, 2]
    assert payload["session"]["id"] == sessions[0].id and payload["compactions"] == []
    code, text = run(capsys, "--db", str(db), "show", sessions[0].id)
    assert code == 0 and sessions[0].id in text and "turn" in text


def test_show_unknown_session_is_one_line(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["logs", "--db", str(db), "show", "nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"liubai: error: no session 'nope' in {db}"]


def test_export_jsonl_and_csv(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out = run(capsys, "--db", str(db), "export", "--format", "jsonl")
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 3 and {"session_id", "prompt_tokens", "cost_usd", "ttft_ms"} <= set(records[0])
    _, out = run(capsys, "--db", str(db), "export", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 3 and rows[0]["prompt_tokens"] == str(records[0]["prompt_tokens"])


def test_path_and_missing_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.db"
    assert run(capsys, "--db", str(missing), "path") == (0, f"{missing}\n")
    assert run(capsys, "--db", str(missing), "--json") == (0, "[]\n")
    assert not missing.exists()  # listing never creates a database


def test_show_says_how_many_facts_a_compaction_kept(
    tmp_path: Path, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "compacted.db"
    replies = ["Hello Ada.", "Noted.", "The user talked about pets."]  # the last is the summary
    session = AgentSession.open(
        ScriptedBackend(tokenizer, replies),  # type: ignore[arg-type]
        Store(path),
        AgentConfig(db=str(path), tools=False),
    )
    session.run_turn("My name is Ada.")
    session.run_turn("My cat is called Pixel and the vet is at 14:30.")
    assert session.compact() is not None
    code, out = run(capsys, "--db", str(path), "show", session.session_id)
    assert code == 0
    (line,) = [row for row in out.splitlines() if "manual" in row]
    assert "kept 3 facts verbatim" in line
    code, out = run(capsys, "--db", str(path), "show", session.session_id, "--json")
    (compaction,) = json.loads(out)["compactions"]
    assert [f["text"] for f in compaction["ledger"]] == ["Ada", "Pixel", "14:30"]


def test_show_says_what_speculation_accepted_where_it_guessed(
    db: Path, tmp_path: Path, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each request's guesses are stored (m005) and ``logs show`` gives the accepted share and the
    tokens per verification step; a session that never speculated keeps its table as it was."""
    path = tmp_path / "spec.db"
    backend = ScriptedBackend(tokenizer, ["One two three.", "Four."], drafts=(3, 12, 7))
    session = AgentSession.open(backend, Store(path), AgentConfig(db=str(path), tools=False))  # type: ignore[arg-type]
    session.run_turn("first")
    session.run_turn("second")
    rows = Store(path).requests(session.session_id)
    assert [(r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"]) for r in rows] == [
        (3, 12, 7)
    ] * 2

    code, out = run(capsys, "--db", str(path), "show", session.session_id)
    assert code == 0
    header, *lines = out.splitlines()[2:]
    assert header.split()[-5:] == ["decode", "accepted", "weights", "kv", "cost"]
    assert [line for line in lines if "7/12 (58%) · 3.3/step" in line] == lines
    _, exported = run(capsys, "--db", str(path), "export", "--format", "jsonl")
    assert json.loads(exported.splitlines()[0])["num_accepted_tokens"] == 7

    plain = Store(db).list_sessions()[0].id
    code, out = run(capsys, "--db", str(db), "show", plain)
    assert code == 0 and "accepted" not in out


def test_show_says_how_each_request_ran_its_weights(
    tmp_path: Path, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each request stores its weight format and whether decode ran compiled (m006); ``logs show``
    prints them per request, and a request stored before m006 (NULL) shows "-"."""
    path = tmp_path / "weights.db"
    backend = ScriptedBackend(tokenizer, ["One two three.", "Four."], weights="int4", compiled=True)
    session = AgentSession.open(backend, Store(path), AgentConfig(db=str(path), tools=False))  # type: ignore[arg-type]
    session.run_turn("first")
    backend.compiled_step = False  # a step that fell back to eager for the second turn
    session.run_turn("second")
    store = Store(path)
    rows = store.requests(session.session_id)
    assert [(r["weights"], r["compiled"]) for r in rows] == [("int4", 1), ("int4", 0)]
    store.db.execute("update requests set weights = null, compiled = null where id = ?", [rows[0]["id"]])
    store.db.conn.commit()
    store.close()

    code, out = run(capsys, "--db", str(path), "show", session.session_id)
    assert code == 0
    header, *lines = out.splitlines()[2:]
    assert header.split()[-4:] == ["decode", "weights", "kv", "cost"]
    column = re.split(r"\s{2,}", header).index("weights")  # cells are two spaces apart
    assert [re.split(r"\s{2,}", line)[column] for line in lines] == ["-", "int4 eager"]
    _, exported = run(capsys, "--db", str(path), "export", "--format", "jsonl")
    assert [json.loads(line)["weights"] for line in exported.splitlines()] == [None, "int4"]


def test_database_from_a_newer_liubai_is_one_line(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(db)
    store.db.table("_migrations").insert({"name": "m999_from_the_future", "applied_at": "2099-01-01"})
    store.close()
    assert cli.main(["logs", "--db", str(db)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("liubai: error: ") and "m999_from_the_future" in err[0]
