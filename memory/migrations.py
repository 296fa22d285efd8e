"""The store's schema, as numbered migrations applied in order when a database opens.

Following simonw/llm: each migration is a function named ``mNNN_what`` that receives the
``sqlite_utils.Database``; the names of applied ones are recorded in ``_migrations``, so a
migration runs once per database, and a name this version does not know means the database was
written by a newer liubai. Never edit or renumber a migration that has shipped; add a new one.
"""

from collections.abc import Callable

import sqlite_utils

Migration = Callable[[sqlite_utils.Database], None]
MIGRATIONS: list[Migration] = []


def migration(fn: Migration) -> Migration:
    MIGRATIONS.append(fn)
    return fn


@migration
def m001_initial(db: sqlite_utils.Database) -> None:
    db["sessions"].create(  # type: ignore[union-attr]
        {
            "id": str,
            "created": str,
            "updated": str,
            "model": str,
            "backend": str,
            "system": str,
            "budget_spec": str,  # as the user gave it: "24MiB" or "4096tok"
            "budget_tokens": int,  # what that budget holds at the session's bytes per token
            "bytes_per_token": int,  # None on a remote backend
            "k_dtype": str,
            "v_dtype": str,
            "high_watermark": float,
            "low_watermark": float,
            "reserve_tokens": int,
            "summary_id": int,  # the summary now in the prompt, if any
            "window_start": int,  # seq of the first message in the recent-turns section
            "title": str,
        },
        pk="id",
    )
    db["messages"].create(  # type: ignore[union-attr]
        {
            "id": int,
            "session_id": str,
            "seq": int,  # order within the session
            "turn": int,  # the user turn a message belongs to (1-based)
            "role": str,  # system / user / assistant / tool
            "kind": str,  # "chat" (said in the conversation) or "recall" (a note of recalled text)
            "content": str,
            "token_count": int,  # tokens of its rendered chat-template segment
            "state": str,  # live / summarized / evicted
            "pinned": int,
            "interrupted": int,  # an assistant reply cut short (Ctrl-C)
            "created": str,
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
    )
    db["messages"].create_index(["session_id", "seq"], unique=True)  # type: ignore[union-attr]
    db["messages"].enable_fts(["content"], fts_version="FTS5", create_triggers=True)  # type: ignore[union-attr]
    db["summaries"].create(  # type: ignore[union-attr]
        {
            "id": int,
            "session_id": str,
            "created": str,
            "text": str,
            "message_ids": str,  # JSON list: every message this summary stands for
            "token_count": int,
            "previous_id": int,  # the summary it replaced and folded in
            "depth": int,  # how many times the summary itself was re-summarized to fit
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
    )
    db["compactions"].create(  # type: ignore[union-attr]
        {
            "id": int,
            "session_id": str,
            "created": str,
            "trigger": str,  # manual / auto
            "focus": str,
            "tokens_before": int,
            "tokens_after": int,
            "dropped_ids": str,  # JSON list of message ids that left the live context
            "summary_id": int,
            "duration_ms": float,
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id"), ("summary_id", "summaries", "id")],
    )
    db["requests"].create(  # type: ignore[union-attr]
        {
            "id": int,
            "session_id": str,
            "created": str,
            "kind": str,  # turn / tool / summary
            "turn": int,
            "model": str,
            "backend": str,
            "k_dtype": str,
            "v_dtype": str,
            "prompt_tokens": int,
            "cached_tokens": int,
            "prefilled_tokens": int,
            "generated_tokens": int,
            "queue_ms": float,
            "prefill_ms": float,
            "ttft_ms": float,
            "decode_ms": float,
            "prefill_tok_s": float,
            "decode_tok_s": float,
            "kv_tokens": int,  # prompt + generated: what the request held in the KV cache
            "kv_bytes": int,
            "budget_tokens": int,
            "compute_s": float,
            "cost_usd": float,
            "finish_reason": str,
            "interrupted": int,
            "token_source": str,  # engine / server / tokenizer / tiktoken
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
    )
    db["requests"].create_index(["session_id"])  # type: ignore[union-attr]


@migration
def m002_session_token_source(db: sqlite_utils.Database) -> None:
    """How the session's token counts were made: tokenizer, tiktoken or estimate (remote models)."""
    db["sessions"].add_column("token_source", str)  # type: ignore[union-attr]
    db.execute("update sessions set token_source = 'tokenizer'")


@migration
def m003_compaction_ledger(db: sqlite_utils.Database) -> None:
    """The fact ledger each compaction kept verbatim (JSON list of facts; NULL in compactions
    recorded before the ledger existed, read back as an empty list) and how many it folded."""
    db["compactions"].add_column("ledger", str)  # type: ignore[union-attr]
    db["compactions"].add_column("num_facts_folded", int)  # type: ignore[union-attr]


@migration
def m004_request_disk_hits(db: sqlite_utils.Database) -> None:
    """Of each request's cached tokens, how many the prefix cache's disk tier loaded (0 in
    requests recorded before the tier existed: they had none)."""
    db["requests"].add_column("disk_cached_tokens", int, not_null_default=0)  # type: ignore[union-attr]


@migration
def m005_request_speculation(db: sqlite_utils.Database) -> None:
    """Each request's speculative decoding: verification steps, guessed tokens and the guesses the
    model accepted (RequestMetrics' num_drafts / num_draft_tokens / num_accepted_tokens; 0 in
    requests recorded before speculation existed: they guessed nothing)."""
    for column in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        db["requests"].add_column(column, int, not_null_default=0)  # type: ignore[union-attr]


@migration
def m006_request_weights(db: sqlite_utils.Database) -> None:
    """How each request's model ran: its weight format ("float32", "bfloat16", "int8", "int4")
    and whether its decode steps ran through compiled graphs (1/0). NULL where unknown: requests
    recorded before these columns existed, and remote backends, which do not say."""
    db["requests"].add_column("weights", str)  # type: ignore[union-attr]
    db["requests"].add_column("compiled", int)  # type: ignore[union-attr]
