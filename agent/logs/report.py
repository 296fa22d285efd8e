"""``liubai logs``: what each session cost and how fast it ran, read back from the store.

``logs`` lists sessions (turns, prompt/cached/generated tokens, median TTFT, decode speed,
compute seconds, dollars); ``logs show ID`` lists a session's every request and compaction;
``logs export`` writes every request as JSON lines or CSV; ``logs path`` prints the database's
location. ``--json`` turns any listing into JSON for scripts.
"""

import csv
import json
import statistics
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from memory.compaction import describe_facts
from memory.store import Store
from runtime.engine.metrics import RequestMetrics

SPEC_COLUMNS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass(slots=True)
class SessionSummary:
    id: str
    started: str
    model: str
    backend: str
    turns: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_ms_median: float
    decode_tok_s: float
    compute_s: float
    cost_usd: float | None
    compactions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_sessions(store: Store) -> list[SessionSummary]:
    requests: dict[str, list[dict[str, Any]]] = {}
    for row in store.requests():
        requests.setdefault(row["session_id"], []).append(row)
    turns = dict(
        store.db.execute(
            "select session_id, count(*) from messages where role = 'user' and kind = 'chat' "
            "group by session_id"
        ).fetchall()
    )
    compactions = dict(
        store.db.execute("select session_id, count(*) from compactions group by session_id").fetchall()
    )
    summaries = []
    for session in store.list_sessions():
        rows = requests.get(session.id, [])
        answered = [r for r in rows if r["kind"] != "summary"]
        decode_ms = sum(r["decode_ms"] or 0 for r in rows)
        decoded = sum(max(0, (r["generated_tokens"] or 0) - 1) for r in rows)
        costs = [r["cost_usd"] for r in rows if r["cost_usd"] is not None]
        ttfts = [r["ttft_ms"] for r in answered if r["ttft_ms"] is not None]
        summaries.append(
            SessionSummary(
                id=session.id,
                started=session.created,
                model=session.model,
                backend=session.backend,
                turns=int(turns.get(session.id, 0)),
                requests=len(rows),
                prompt_tokens=sum(r["prompt_tokens"] or 0 for r in rows),
                cached_tokens=sum(r["cached_tokens"] or 0 for r in rows),
                generated_tokens=sum(r["generated_tokens"] or 0 for r in rows),
                ttft_ms_median=round(statistics.median(ttfts), 3) if ttfts else 0.0,
                decode_tok_s=round(decoded / (decode_ms / 1000), 3) if decode_ms > 0 else 0.0,
                compute_s=round(sum(r["compute_s"] or 0 for r in rows), 6),
                cost_usd=round(sum(costs), 9) if costs else None,
                compactions=int(compactions.get(session.id, 0)),
            )
        )
    return summaries


def _table(headers: list[str], rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    right = [i > 2 for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        )

    out.write(line(headers).rstrip() + "\n")
    for row in rows:
        out.write(line(row).rstrip() + "\n")


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:.6f}"


def list_sessions(store: Store, as_json: bool, out: TextIO) -> None:
    summaries = summarize_sessions(store)
    if as_json:
        out.write(json.dumps([s.to_dict() for s in summaries], ensure_ascii=False) + "\n")
        return
    if not summaries:
        out.write(f"no sessions yet in {store.path}\n")
        return
    headers = [
        "session",
        "started",
        "model",
        "turns",
        "prompt",
        "cached",
        "generated",
        "ttft p50",
        "decode",
        "compute",
        "cost",
    ]
    rows = [
        [
            s.id,
            s.started[:19].replace("T", " "),
            s.model,
            str(s.turns),
            f"{s.prompt_tokens:,}",
            f"{s.cached_tokens:,}",
            f"{s.generated_tokens:,}",
            f"{s.ttft_ms_median:.0f} ms",
            f"{s.decode_tok_s:.1f} tok/s",
            f"{s.compute_s:.2f} s",
            _usd(s.cost_usd),
        ]
        for s in summaries
    ]
    _table(headers, rows, out)


def show_session(store: Store, session_id: str, as_json: bool, out: TextIO) -> None:
    session = store.get_session(session_id)
    requests = store.requests(session_id)
    compactions = store.compactions(session_id)
    if as_json:
        payload = {
            "session": asdict(session),
            "requests": requests,
            "compactions": [asdict(c) for c in compactions],
        }
        out.write(json.dumps(payload, ensure_ascii=False) + "\n")
        return
    out.write(
        f"session {session.id} · {session.model} ({session.backend}) · started {session.created[:19]} · "
        f"budget {session.budget_spec} = {session.budget_tokens:,} tok · "
        f"KV {session.k_dtype}/{session.v_dtype}\n\n"
    )
    headers = [
        "#",
        "kind",
        "turn",
        "prompt",
        "cached",
        "disk",
        "prefilled",
        "generated",
        "ttft",
        "prefill",
        "decode",
        "kv",
        "cost",
    ]
    rows = [
        [
            str(r["id"]),
            r["kind"],
            str(r["turn"]),
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            str(r.get("disk_cached_tokens") or 0),
            str(r["prefilled_tokens"]),
            str(r["generated_tokens"]),
            f"{r['ttft_ms'] or 0:.0f} ms",
            f"{r['prefill_ms'] or 0:.0f} ms",
            f"{r['decode_tok_s'] or 0:.1f} tok/s",
            f"{r['kv_tokens'] or 0:,}",
            _usd(r["cost_usd"]),
        ]
        for r in requests
    ]
    if any(r.get("weights") for r in requests):  # a local model: how it ran (NULL before m006)
        headers.insert(headers.index("decode") + 1, "weights")
        for row, r in zip(rows, requests, strict=True):
            row.insert(headers.index("weights"), _weights(r))
    if any(r.get("num_drafts") for r in requests):  # a session that speculated: its acceptance
        headers.insert(headers.index("decode") + 1, "accepted")
        for row, r in zip(rows, requests, strict=True):
            row.insert(headers.index("accepted"), _acceptance(r))
    _table(headers, rows, out)
    if compactions:
        out.write("\ncompactions\n")
        for c in compactions:
            out.write(
                f"  {c.created[:19].replace('T', ' ')}  {c.trigger:<6}  "
                f"{c.tokens_before:,} → {c.tokens_after:,} tokens  "
                f"{len(c.dropped_ids)} messages  {c.duration_ms:.0f} ms"
                + (f"  kept {describe_facts(c.num_facts_kept)} verbatim" if c.ledger else "")
                + (f"  focus: {c.focus}" if c.focus else "")
                + "\n"
            )


def _weights(row: dict[str, Any]) -> str:
    """A request's weight format and whether its decode steps ran compiled ("int4 compiled",
    "float32 eager"); "-" where the request did not record them."""
    if not row.get("weights"):
        return "-"
    if row.get("compiled") is None:
        return str(row["weights"])
    return f"{row['weights']} {'compiled' if row['compiled'] else 'eager'}"


def _acceptance(row: dict[str, Any]) -> str:
    """A request's speculation: the guesses the model accepted of those drafted, and the tokens a
    verification step yielded on average (as RequestMetrics computes them); "-" where none."""
    drafts, drafted, accepted = (int(row.get(k) or 0) for k in SPEC_COLUMNS)
    if not drafts:
        return "-"
    metrics = RequestMetrics(num_drafts=drafts, num_draft_tokens=drafted, num_accepted_tokens=accepted)
    return f"{accepted}/{drafted} ({metrics.acceptance_rate:.0%}) · {metrics.mean_accepted_length:.1f}/step"


def export_requests(store: Store, fmt: str, session_id: str | None, out: TextIO) -> None:
    if session_id is not None:
        store.get_session(session_id)
    rows = store.requests(session_id)
    if fmt == "jsonl":
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    columns = list(rows[0]) if rows else [c.name for c in store.db["requests"].columns]
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
