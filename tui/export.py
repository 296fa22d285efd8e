"""``/export PATH``: every message of the session, whatever its state, as Markdown or JSON lines.

The export is read from the context manager's record of the session (the same rows the store
holds), so summarized and evicted turns are included and marked, and so is each message's turn.
The format follows the file's extension: ``.md``/``.markdown`` for reading, ``.jsonl`` for tools.
"""

import json
from pathlib import Path
from typing import Any

from agent.session import AgentSession
from memory.store import MessageRecord


def export_session(session: AgentSession, path: str | Path) -> int:
    """Write the session to ``path``; return the number of messages written (OSError if it cannot)."""
    target = Path(path).expanduser()
    messages = session.context.messages()
    if target.suffix.lower() == ".jsonl":
        text = "".join(json.dumps(_record(session, m), ensure_ascii=False) + "\n" for m in messages)
    else:
        text = _markdown(session, messages)
    target.write_text(text, encoding="utf-8")
    return len(messages)


def _record(session: AgentSession, m: MessageRecord) -> dict[str, Any]:
    return {
        "session_id": session.session_id,
        "seq": m.seq,
        "turn": m.turn,
        "role": m.role,
        "kind": m.kind,
        "state": m.state,
        "pinned": m.pinned,
        "interrupted": m.interrupted,
        "tokens": m.token_count,
        "created": m.created,
        "content": m.content,
    }


def _markdown(session: AgentSession, messages: list[MessageRecord]) -> str:
    lines = [
        f"# liubai session {session.session_id}",
        "",
        f"- model: {session.backend.model_name}",
        f"- KV budget: {session.context.budget.describe()}",
        f"- messages: {len(messages)}",
    ]
    turn = -1
    for m in messages:
        if m.turn != turn:
            turn = m.turn
            lines += ["", "## System" if turn == 0 else f"## Turn {turn}"]
        marks = [m.state, *(["pinned"] if m.pinned else []), *(["interrupted"] if m.interrupted else [])]
        kind = f" ({m.kind})" if m.kind != "chat" else ""
        lines += ["", f"**{m.role}**{kind} · {' · '.join(marks)} · {m.token_count} tok", "", m.content]
    if session.context.summary is not None:
        lines += ["", "## Current summary", "", session.context.summary]
    return "\n".join(lines) + "\n"
