"""Bringing evicted turns back: full-text search over what left the live context.

For each new user message the context manager searches the session's summarized and evicted
messages (SQLite FTS5, ranked by bm25) with the message's content words, and puts the best
matches, verbatim and bounded by a share of the budget, into the prompt as a recall note. The
same search is exposed to the agent as its ``recall`` tool.

The note is placed directly before the message it serves and stays with that turn afterwards.
Placing it ahead of all recent turns, and changing it every turn, would shift every recent turn
and so invalidate the prefix cache for all of them on every request.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .store import SearchHit, Store

# Words that match everywhere and so rank nothing.
STOPWORDS = frozenset(
    """a about above after again all also am an and any are as at be because been before being below
    between both but by can could did do does doing done down during each else ever few for from had
    has have having he her here hers him his how i if in into is it its itself just me more most my
    no nor not now of off on once only or other our ours out over own please same she should so some
    such tell than that the their theirs them then there these they this those through to too under
    until up very was we were what when where which while who whom why will with would you your
    yours remember recall earlier said told mentioned again know""".split()
)
_WORD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-']*")
NOTE_HEADER = "Recalled from earlier in this conversation (no longer in the live context):"


def fts_query(text: str, max_terms: int = 24) -> str:
    """Free text to an FTS5 query: its content words, each quoted, joined with OR."""
    seen: list[str] = []
    for word in _WORD_RE.findall(text.lower()):
        word = word.strip("'-")
        if len(word) < 2 or word in STOPWORDS or word in seen:
            continue
        seen.append(word)
        if len(seen) == max_terms:
            break
    return " OR ".join('"' + w.replace('"', "") + '"' for w in seen)


def format_hit(hit: SearchHit) -> str:
    return f"[turn {hit.turn}, {hit.role}] {hit.content}"


def render_note(hits: Iterable[SearchHit]) -> str:
    return "\n".join([NOTE_HEADER, *(format_hit(h) for h in hits)])


@dataclass(slots=True)
class Recall:
    """What was recalled for one message: the hits, in rank order, and the note's text."""

    hits: list[SearchHit]
    note: str
    turn: int  # the turn whose new message the note serves


def recall_for(
    store: Store,
    session_id: str,
    text: str,
    turn: int,
    max_tokens: int,
    count_tokens: Callable[[str], int],
    live_notes: list[str],
    limit: int = 4,
    min_relevance: float = 0.5,
) -> Recall | None:
    """The best-ranked evicted messages for ``text`` whose note fits in ``max_tokens``.

    Messages already recalled into the live context (their line is in one of ``live_notes``)
    are skipped; hits are taken in rank order while the note still fits, and only while they
    score at least ``min_relevance`` of the best hit's bm25 (a message that shares one common
    word with the question is not worth its tokens).
    """
    query = fts_query(text)
    if not query or max_tokens <= 0:
        return None
    chosen: list[SearchHit] = []
    hits = store.search(session_id, query, limit=limit * 4)
    best = hits[0].rank if hits else 0.0  # bm25 in SQLite: more negative is more relevant
    for hit in hits:
        if hit.rank > best * min_relevance:
            break
        if any(format_hit(hit) in note for note in live_notes):
            continue
        if count_tokens(render_note([*chosen, hit])) > max_tokens:
            continue
        chosen.append(hit)
        if len(chosen) == limit:
            break
    if not chosen:
        return None
    return Recall(chosen, render_note(chosen), turn)
