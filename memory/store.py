"""Everything a conversation ever contained, in SQLite: the one place nothing is lost.

The store wraps a ``sqlite_utils.Database`` in WAL mode (a TUI and a headless run can share one
file) and applies the numbered migrations of ``memory/migrations.py`` when it opens. Writes
that belong together (a compaction: its summary, its record and the state of every message it
dropped) happen in one transaction, so a crash leaves either all of it or none.

The rows it reads come back as the values of ``memory/records.py``.

SQLite's own failures become :class:`StoreError` with one readable line: a locked database, a
file that is not a database, a directory that cannot be written, a schema from a newer liubai.
"""

import json
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

from memory.compaction import CompactionEvent
from memory.errors import SessionNotFoundError, StoreError
from memory.migrations import MIGRATIONS
from memory.records import (
    MESSAGE_STATES,
    CompactionRecord,
    MessageRecord,
    SearchHit,
    SessionRecord,
    SummaryRecord,
    from_row,
)
from runtime.paths import data_dir

DB_FILENAME = "liubai.db"
BUSY_TIMEOUT_MS = 5000


def default_db_path() -> Path:
    return data_dir() / DB_FILENAME


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _phrase(term: str) -> str:
    """A term as one quoted FTS5 phrase, whatever characters it holds."""
    return '"' + term.replace('"', "") + '"'


class Store:
    """A liubai database. Opening it migrates it; ``path=None`` means the user data dir."""

    def __init__(self, path: str | Path | None = None, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the directory for {self.path}: {exc.strerror or exc}") from exc
        try:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._error("open", exc) from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            self.db = sqlite_utils.Database(conn)
            self.db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
            if self.db.journal_mode != "wal":
                self.db.enable_wal()
        except BaseException as exc:
            conn.close()  # a refused database must not stay open (nor locked) behind the error
            if isinstance(exc, sqlite3.Error):
                raise self._error("open", exc) from exc
            raise

    # -- lifecycle ----------------------------------------------------------------------------

    def _error(self, action: str, exc: sqlite3.Error) -> StoreError:
        text = str(exc)
        if "locked" in text or "busy" in text:
            return StoreError(f"the database {self.path} is locked by another process; try again")
        if "not a database" in text or "malformed" in text:
            return StoreError(f"{self.path} is not a readable liubai database ({text}); nothing was changed")
        if "readonly" in text or "unable to open" in text:
            return StoreError(f"cannot {action} the database {self.path}: {text}")
        return StoreError(f"cannot {action} the database {self.path}: {text}")

    def _migrate(self) -> None:
        known = [m.__name__ for m in MIGRATIONS]
        table = self.db.table("_migrations")
        if not table.exists():
            table.create({"name": str, "applied_at": str}, pk="name")  # type: ignore[union-attr]
        applied = {row["name"] for row in table.rows}
        unknown = sorted(applied - set(known))
        if unknown:
            raise StoreError(
                f"{self.path} was written by a newer liubai (schema migration {unknown[-1]}); "
                "upgrade liubai to open it"
            )
        for fn in MIGRATIONS:
            if fn.__name__ in applied:
                continue
            with self._transaction():
                fn(self.db)
                table.insert({"name": fn.__name__, "applied_at": now_iso()})

    @property
    def schema_version(self) -> int:
        return self.db["_migrations"].count

    def close(self) -> None:
        self.db.conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        conn = self.db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # a failed COMMIT (busy) leaves it open; never leave it so
                conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _writing(self, action: str) -> Iterator[None]:
        try:
            with self._transaction():
                yield
        except sqlite3.Error as exc:
            raise self._error(action, exc) from exc

    def _table(self, name: str) -> sqlite_utils.db.Table:
        return self.db.table(name)

    def _query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        try:
            return list(self.db.query(sql, params))
        except sqlite3.Error as exc:
            raise self._error("read", exc) from exc

    # -- sessions -----------------------------------------------------------------------------

    def create_session(
        self,
        *,
        model: str,
        backend: str,
        system: str,
        budget_spec: str,
        budget_tokens: int,
        bytes_per_token: int | None,
        k_dtype: str | None,
        v_dtype: str | None,
        high_watermark: float,
        low_watermark: float,
        reserve_tokens: int,
        session_id: str | None = None,
        token_source: str = "tokenizer",
    ) -> SessionRecord:
        stamp = now_iso()
        row = {
            "id": session_id or uuid.uuid4().hex[:12],
            "created": stamp,
            "updated": stamp,
            "model": model,
            "backend": backend,
            "system": system,
            "budget_spec": budget_spec,
            "budget_tokens": budget_tokens,
            "bytes_per_token": bytes_per_token,
            "k_dtype": k_dtype,
            "v_dtype": v_dtype,
            "high_watermark": high_watermark,
            "low_watermark": low_watermark,
            "reserve_tokens": reserve_tokens,
            "summary_id": None,
            "window_start": 0,
            "title": None,
            "token_source": token_source,
        }
        with self._writing("write"):
            self._table("sessions").insert(row)
        return from_row(SessionRecord, row)  # type: ignore[no-any-return]

    def get_session(self, session_id: str) -> SessionRecord:
        rows = self._query("select * from sessions where id = ?", [session_id])
        if not rows:
            raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")
        return from_row(SessionRecord, rows[0])  # type: ignore[no-any-return]

    def update_session(self, session_id: str, **changes: Any) -> None:
        changes["updated"] = now_iso()
        with self._writing("write"):
            self._table("sessions").update(session_id, changes)

    def list_sessions(self) -> list[SessionRecord]:
        return [from_row(SessionRecord, r) for r in self._query("select * from sessions order by created")]

    # -- messages -----------------------------------------------------------------------------

    def add_message(
        self,
        session_id: str,
        *,
        role: str,
        content: str,
        token_count: int,
        turn: int,
        kind: str = "chat",
        pinned: bool = False,
        interrupted: bool = False,
        state: str = "live",
    ) -> MessageRecord:
        with self._writing("write"):
            seq = self.db.execute(
                "select coalesce(max(seq), 0) + 1 from messages where session_id = ?", [session_id]
            ).fetchone()[0]
            row = {
                "session_id": session_id,
                "seq": seq,
                "turn": turn,
                "role": role,
                "kind": kind,
                "content": content,
                "token_count": token_count,
                "state": state,
                "pinned": int(pinned),
                "interrupted": int(interrupted),
                "created": now_iso(),
            }
            row["id"] = self._table("messages").insert(row).last_pk
            self.db.execute("update sessions set updated = ? where id = ?", [row["created"], session_id])
        return from_row(MessageRecord, row)  # type: ignore[no-any-return]

    def messages(self, session_id: str, states: Sequence[str] | None = None) -> list[MessageRecord]:
        sql = "select * from messages where session_id = ?"
        params: list[Any] = [session_id]
        if states is not None:
            sql += f" and state in ({', '.join('?' for _ in states)})"
            params.extend(states)
        return [from_row(MessageRecord, r) for r in self._query(sql + " order by seq", params)]

    def set_message(self, message_id: int, **changes: Any) -> None:
        with self._writing("write"):
            self._table("messages").update(message_id, changes)

    def _set_state(self, message_ids: Sequence[int], state: str) -> None:
        assert state in MESSAGE_STATES, state
        for message_id in message_ids:
            self.db.execute("update messages set state = ? where id = ?", [state, message_id])

    def search(
        self, session_id: str, query: str, limit: int = 5, states: Sequence[str] = ("summarized", "evicted")
    ) -> list[SearchHit]:
        """Full-text search (FTS5, bm25) over this session's conversation messages in ``states``.

        ``query`` is FTS5 syntax; :func:`memory.recall.fts_query` turns free text into it.
        """
        if not query:
            return []
        sql = f"""
            select m.id, m.turn, m.role, m.content, m.state, bm25(messages_fts) as rank
            from messages_fts join messages m on m.rowid = messages_fts.rowid
            where messages_fts match ? and m.session_id = ? and m.kind = 'chat'
              and m.state in ({", ".join("?" for _ in states)})
            order by rank limit ?
        """
        rows = self._query(sql, [query, session_id, *states, limit])
        return [
            SearchHit(r["id"], r["turn"], r["role"], r["content"], r["state"], float(r["rank"])) for r in rows
        ]

    def document_frequencies(
        self, session_id: str, terms: Sequence[str], states: Sequence[str] = ("summarized", "evicted")
    ) -> tuple[int, dict[str, int]]:
        """How many of this session's conversation messages in ``states`` there are, and how many
        of them contain each term (an FTS5 phrase match, as :meth:`search` matches it)."""
        where = f"m.session_id = ? and m.kind = 'chat' and m.state in ({', '.join('?' for _ in states)})"
        total = self._query(f"select count(*) as n from messages m where {where}", [session_id, *states])
        counts: dict[str, int] = {}
        for term in terms:
            rows = self._query(
                f"""select count(*) as n from messages_fts join messages m on m.rowid = messages_fts.rowid
                    where messages_fts match ? and {where}""",
                [_phrase(term), session_id, *states],
            )
            counts[term] = int(rows[0]["n"])
        return int(total[0]["n"]), counts

    # -- summaries and compactions ------------------------------------------------------------

    def record_compaction(self, compaction: CompactionEvent) -> CompactionEvent:
        """Write a compaction in one transaction: summary, record, message states, session front.

        Returns the compaction with the ids the store gave it (``compaction_id``, and
        ``summary_id``: the new summary's, or the previous one when there is no new summary).
        The live context may change only after this returns: if it raises, nothing was written
        and nothing was dropped.
        """
        c = compaction
        stamp = now_iso()
        with self._writing("write"):
            summary_id = c.previous_summary_id
            if c.summary_text is not None:
                summary_id = (
                    self._table("summaries")
                    .insert(
                        {
                            "session_id": c.session_id,
                            "created": stamp,
                            "text": c.summary_text,
                            "message_ids": json.dumps(list(c.summary_message_ids)),
                            "token_count": c.summary_tokens,
                            "previous_id": c.previous_summary_id,
                            "depth": c.summary_depth,
                        }
                    )
                    .last_pk
                )
            compaction_id = (
                self._table("compactions")
                .insert(
                    {
                        "session_id": c.session_id,
                        "created": stamp,
                        "trigger": c.trigger,
                        "focus": c.focus,
                        "tokens_before": c.tokens_before,
                        "tokens_after": c.tokens_after,
                        "dropped_ids": json.dumps([*c.summarized_ids, *c.evicted_ids]),
                        "summary_id": summary_id,
                        "duration_ms": c.duration_ms,
                        "ledger": json.dumps(c.ledger, ensure_ascii=False),
                        "num_facts_folded": c.num_facts_folded,
                    }
                )
                .last_pk
            )
            self._set_state(c.summarized_ids, "summarized")
            self._set_state(c.evicted_ids, "evicted")
            self._table("sessions").update(
                c.session_id, {"summary_id": summary_id, "window_start": c.window_start, "updated": stamp}
            )
        return replace(compaction, compaction_id=int(compaction_id or 0), summary_id=summary_id)

    def get_summary(self, summary_id: int) -> SummaryRecord:
        rows = self._query("select * from summaries where id = ?", [summary_id])
        if not rows:
            raise StoreError(f"summary {summary_id} is missing from {self.path}")
        return from_row(SummaryRecord, rows[0])  # type: ignore[no-any-return]

    def summaries(self, session_id: str) -> list[SummaryRecord]:
        rows = self._query("select * from summaries where session_id = ? order by id", [session_id])
        return [from_row(SummaryRecord, r) for r in rows]

    def compactions(self, session_id: str) -> list[CompactionRecord]:
        rows = self._query("select * from compactions where session_id = ? order by id", [session_id])
        return [from_row(CompactionRecord, r) for r in rows]

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, session_id: str, row: dict[str, Any]) -> int:
        record = {"session_id": session_id, "created": now_iso(), **row}
        with self._writing("write"):
            request_id = self._table("requests").insert(record, alter=False).last_pk
        return int(request_id or 0)

    def requests(self, session_id: str | None = None) -> list[dict[str, Any]]:
        if session_id is None:
            return self._query("select * from requests order by id")
        return self._query("select * from requests where session_id = ? order by id", [session_id])


__all__ = [
    "CompactionRecord",
    "MessageRecord",
    "SearchHit",
    "SessionRecord",
    "Store",
    "SummaryRecord",
    "default_db_path",
]
