"""The store: its schema as the migrations build it, and the failures it must turn into one clear
``StoreError`` without changing or losing what is on disk (a newer schema, a file that is not a
database, a database another process has locked)."""

import random
import sqlite3
from pathlib import Path

import pytest

from memory import CompactionEvent, Store, StoreError
from memory.migrations import MIGRATIONS
from memory.store import SessionRecord

SCHEMA = {
    "sessions": [
        "id", "created", "updated", "model", "backend", "system", "budget_spec", "budget_tokens",
        "bytes_per_token", "k_dtype", "v_dtype", "high_watermark", "low_watermark", "reserve_tokens",
        "summary_id", "window_start", "title", "token_source",
    ],
    "messages": [
        "id", "session_id", "seq", "turn", "role", "kind", "content", "token_count", "state", "pinned",
        "interrupted", "created",
    ],
    "summaries": [
        "id", "session_id", "created", "text", "message_ids", "token_count", "previous_id", "depth",
    ],
    "compactions": [
        "id", "session_id", "created", "trigger", "focus", "tokens_before", "tokens_after", "dropped_ids",
        "summary_id", "duration_ms", "ledger", "num_facts_folded",
    ],
    "requests": [
        "id", "session_id", "created", "kind", "turn", "model", "backend", "k_dtype", "v_dtype",
        "prompt_tokens", "cached_tokens", "prefilled_tokens", "generated_tokens", "queue_ms", "prefill_ms",
        "ttft_ms", "decode_ms", "prefill_tok_s", "decode_tok_s", "kv_tokens", "kv_bytes", "budget_tokens",
        "compute_s", "cost_usd", "finish_reason", "interrupted", "token_source", "disk_cached_tokens",
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "weights", "compiled",
    ],
    "_migrations": ["name", "applied_at"],
}  # fmt: skip


def new_session(store: Store) -> SessionRecord:
    return store.create_session(
        model="m",
        backend="local",
        system="You are a helpful assistant.",
        budget_spec="4096tok",
        budget_tokens=4096,
        bytes_per_token=46080,
        k_dtype="float32",
        v_dtype="float32",
        high_watermark=0.85,
        low_watermark=0.55,
        reserve_tokens=256,
    )


def schema_sql(path: Path) -> list[tuple[str, str]]:
    conn = sqlite3.connect(path)
    try:
        return sorted(conn.execute("select name, coalesce(sql, '') from sqlite_master").fetchall())
    finally:
        conn.close()


def test_fresh_database_has_the_schema(tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    tables = set(store.db.table_names())
    assert set(SCHEMA) <= tables
    assert "messages_fts" in tables
    for table, columns in SCHEMA.items():
        assert [c.name for c in store.db[table].columns] == columns, table
    assert [r["name"] for r in store.db["_migrations"].rows] == [m.__name__ for m in MIGRATIONS]
    assert store.schema_version == len(MIGRATIONS)
    assert store.db.journal_mode == "wal"
    assert store.db.table("messages").foreign_keys[0].other_table == "sessions"
    store.close()


def test_reopening_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "liubai.db"
    store = Store(path)
    session = new_session(store)
    store.add_message(session.id, role="user", content="hello", token_count=3, turn=1)
    applied = list(store.db["_migrations"].rows)
    store.close()
    before = schema_sql(path)

    again = Store(path)
    assert list(again.db["_migrations"].rows) == applied
    assert [m.content for m in again.messages(session.id)] == ["hello"]
    again.close()
    assert schema_sql(path) == before


def test_database_from_a_newer_liubai_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "liubai.db"
    store = Store(path)
    store.db.table("_migrations").insert({"name": "m999_from_the_future", "applied_at": "2099-01-01"})
    store.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="newer liubai.*m999_from_the_future"):
        Store(path)
    assert path.read_bytes() == before


def test_corrupt_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "liubai.db"
    path.write_bytes(random.Random(0).randbytes(8192))
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a readable liubai database"):
        Store(path)
    assert path.read_bytes() == before


def test_locked_database_gives_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "liubai.db"
    store = Store(path, busy_timeout_ms=50)
    session = new_session(store)
    first = store.add_message(session.id, role="user", content="kept across the lock", token_count=5, turn=1)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError, match="locked by another process"):
            store.add_message(session.id, role="assistant", content="lost?", token_count=3, turn=1)
        with pytest.raises(StoreError, match="locked"):
            store.record_compaction(CompactionEvent(
                session_id=session.id, trigger="manual", focus=None, turns=[1], tokens_before=10,
                tokens_after=5, summarized_ids=[first.id], evicted_ids=[], summary_text="s",
                summary_message_ids=[first.id], summary_tokens=2, window_start=2, duration_ms=1.0,
            ))  # fmt: skip
    finally:
        other.execute("ROLLBACK")
        other.close()
    # Nothing half-written: the message is still live, no summary and no compaction exist.
    assert [(m.content, m.state) for m in store.messages(session.id)] == [("kept across the lock", "live")]
    assert store.summaries(session.id) == [] and store.compactions(session.id) == []
    store.add_message(session.id, role="assistant", content="after the lock", token_count=3, turn=1)
    store.close()
    reopened = Store(path)
    assert [m.content for m in reopened.messages(session.id)] == ["kept across the lock", "after the lock"]
    reopened.close()


def test_unwritable_directory_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create the directory"):
        Store(blocker / "sub" / "liubai.db")


def test_messages_round_trip_byte_for_byte(tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    session = new_session(store)
    texts = ["plain", "ünïcödé ✓ 日本語", "  leading and trailing  \n", "quote ' and \" and \\ and \x00 nul"]
    for turn, text in enumerate(texts, start=1):
        store.add_message(session.id, role="user", content=text, token_count=1, turn=turn)
    stored = store.messages(session.id)
    assert [m.content for m in stored] == texts
    assert [m.seq for m in stored] == [1, 2, 3, 4]
    assert all(m.state == "live" and not m.pinned and m.kind == "chat" for m in stored)


def test_compaction_is_written_in_one_transaction(tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    session = new_session(store)
    ids = [
        store.add_message(session.id, role=role, content=f"{role} {turn}", token_count=2, turn=turn).id
        for turn in (1, 2)
        for role in ("user", "assistant")
    ]
    note = store.add_message(session.id, role="system", content="note", token_count=2, turn=2, kind="recall")
    compaction = CompactionEvent(
        session_id=session.id, trigger="auto", focus="names", turns=[1, 2], tokens_before=40,
        tokens_after=20, summarized_ids=ids[:2], evicted_ids=[note.id], summary_text="turn 1 happened",
        summary_message_ids=ids[:2], summary_tokens=6, window_start=3, duration_ms=12.5,
    )  # fmt: skip
    recorded = store.record_compaction(compaction)
    summary_id = recorded.summary_id
    assert summary_id is not None and recorded.compaction_id > 0
    states = {m.id: m.state for m in store.messages(session.id)}
    assert [states[i] for i in ids] == ["summarized", "summarized", "live", "live"]
    assert states[note.id] == "evicted"
    (record,) = store.compactions(session.id)
    assert record.id == recorded.compaction_id and record.summary_id == summary_id
    assert record.dropped_ids == [*ids[:2], note.id] and record.focus == "names"
    assert store.get_summary(summary_id).message_ids == ids[:2]
    refreshed = store.get_session(session.id)
    assert refreshed.summary_id == summary_id and refreshed.window_start == 3


def test_search_covers_only_left_conversation_messages(tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    session = new_session(store)
    other = new_session(store)
    store.add_message(session.id, role="user", content="the locker code is 4817", token_count=1, turn=1,
                      state="summarized")  # fmt: skip
    store.add_message(session.id, role="user", content="locker again, still live", token_count=1, turn=2)
    store.add_message(session.id, role="system", content="locker note", token_count=1, turn=2, kind="recall",
                      state="evicted")  # fmt: skip
    store.add_message(other.id, role="user", content="another locker", token_count=1, turn=1, state="evicted")
    hits = store.search(session.id, '"locker"')
    assert [h.content for h in hits] == ["the locker code is 4817"]
    total, frequencies = store.document_frequencies(session.id, ["locker", "4817", "absent"])
    assert total == 1 and frequencies == {"locker": 1, "4817": 1, "absent": 0}


def test_requests_are_logged(tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    session = new_session(store)
    store.add_request(session.id, {"kind": "summary", "prompt_tokens": 100, "generated_tokens": 20})
    (row,) = store.requests(session.id)
    assert row["kind"] == "summary" and row["prompt_tokens"] == 100
    with pytest.raises(StoreError):
        store.add_request(session.id, {"no_such_column": 1})


def test_compaction_record_keeps_its_ledger(tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    session = new_session(store)
    first = store.add_message(session.id, role="user", content="my cat is Pixel", token_count=5, turn=1)
    ledger = [{"text": "Pixel", "kind": "name", "cue": "cat", "message_id": first.id, "turn": 1}]
    store.record_compaction(CompactionEvent(
        session_id=session.id, trigger="manual", focus=None, turns=[1], tokens_before=10, tokens_after=5,
        summarized_ids=[first.id], evicted_ids=[], summary_text="s", summary_message_ids=[first.id],
        summary_tokens=2, window_start=2, duration_ms=1.0, ledger=ledger, num_facts_folded=3,
    ))  # fmt: skip
    (record,) = store.compactions(session.id)
    assert record.ledger == ledger and record.num_facts_kept == 1 and record.num_facts_folded == 3
    store.close()


def test_database_from_before_the_ledger_migrates_and_keeps_its_rows(tmp_path: Path) -> None:
    """A database written before m003 opens: its compaction rows read back whole, with no ledger."""
    import sqlite_utils

    path = tmp_path / "old.db"
    db = sqlite_utils.Database(path)
    for fn in MIGRATIONS[:2]:
        fn(db)
    db["_migrations"].insert_all({"name": fn.__name__, "applied_at": "2025-01-01"} for fn in MIGRATIONS[:2])
    db["sessions"].insert({"id": "old", "created": "c", "updated": "u", "model": "m", "backend": "local",
                           "system": "s", "budget_spec": "4096tok", "budget_tokens": 4096,
                           "high_watermark": 0.85, "low_watermark": 0.55, "reserve_tokens": 256,
                           "window_start": 0})  # fmt: skip
    db["compactions"].insert({"session_id": "old", "created": "c", "trigger": "auto", "focus": None,
                              "tokens_before": 900, "tokens_after": 300, "dropped_ids": "[1, 2]",
                              "summary_id": None, "duration_ms": 5.0})  # fmt: skip
    db.conn.close()

    store = Store(path)
    (record,) = store.compactions("old")
    assert (record.tokens_before, record.tokens_after, record.dropped_ids) == (900, 300, [1, 2])
    assert record.ledger == [] and record.num_facts_kept == 0 and record.num_facts_folded == 0
    assert store.schema_version == len(MIGRATIONS)
    store.close()


def test_database_from_before_speculation_migrates_and_reads_zero_guesses(tmp_path: Path) -> None:
    """A database written before m005 opens: its request rows read back whole, with no guesses, and
    new requests record theirs beside them."""
    import sqlite_utils

    path = tmp_path / "old.db"
    db = sqlite_utils.Database(path)
    for fn in MIGRATIONS[:4]:
        fn(db)
    db["_migrations"].insert_all({"name": fn.__name__, "applied_at": "2026-01-01"} for fn in MIGRATIONS[:4])
    db["sessions"].insert({"id": "old", "created": "c", "updated": "u", "model": "m", "backend": "local",
                           "system": "s", "budget_spec": "4096tok", "budget_tokens": 4096,
                           "high_watermark": 0.85, "low_watermark": 0.55, "reserve_tokens": 256,
                           "window_start": 0})  # fmt: skip
    db["requests"].insert({"session_id": "old", "created": "c", "kind": "turn", "turn": 1,
                           "prompt_tokens": 40, "generated_tokens": 9, "disk_cached_tokens": 16})  # fmt: skip
    db.conn.close()

    store = Store(path)
    store.add_request("old", {"kind": "turn", "turn": 2, "num_drafts": 3, "num_draft_tokens": 12,
                              "num_accepted_tokens": 7})  # fmt: skip
    before, after = store.requests("old")
    assert (before["prompt_tokens"], before["generated_tokens"], before["disk_cached_tokens"]) == (40, 9, 16)
    assert (before["num_drafts"], before["num_draft_tokens"], before["num_accepted_tokens"]) == (0, 0, 0)
    assert (after["num_drafts"], after["num_draft_tokens"], after["num_accepted_tokens"]) == (3, 12, 7)
    assert store.schema_version == len(MIGRATIONS)
    assert [r["name"] for r in store.db["_migrations"].rows][4:] == [fn.__name__ for fn in MIGRATIONS[4:]]
    assert (before["weights"], before["compiled"]) == (None, None)  # m006: unknown, not guessed
    store.close()
