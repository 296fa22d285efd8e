"""Bringing evicted turns back: full-text search over what left the live context.

For each new user message the context manager searches the session's summarized and evicted
messages (SQLite FTS5, ranked by bm25) with the message's content words, and puts the best
matches, verbatim and bounded by a share of the budget, into the prompt as a recall note. The
same search is exposed to the agent as its ``recall`` tool.

The note is placed directly before the message it serves and stays with that turn afterwards.
Placing it ahead of all recent turns, and changing it every turn, would shift every recent turn
and so invalidate the prefix cache for all of them on every request.
"""

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from memory.records import MessageRecord, SearchHit
from memory.store import Store

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
# Words as SQLite FTS5's default tokenizer (unicode61) splits them: runs of letters and digits.
_TOKEN_RE = re.compile(r"[^\W_]+")
NOTE_HEADER = "Recalled from earlier in this conversation (no longer in the live context):"


# A term in more than this share of the searched messages (and in more than COMMON_MIN of them)
# is this conversation's own stopword: it matches nearly everything and so recalls noise.
COMMON_SHARE = 0.2
COMMON_MIN = 3
MAX_QUERY_TERMS = 24  # the rarest informative words of a long message are enough to find its matches


def content_terms(text: str, max_terms: int = 24) -> list[str]:
    """The content words of ``text``, lower-cased, in order, without stopwords or repeats."""
    seen: list[str] = []
    for word in _TOKEN_RE.findall(text.lower()):
        if len(word) < 2 or word in STOPWORDS or word in seen:
            continue
        seen.append(word)
        if len(seen) == max_terms:
            break
    return seen


def terms_query(terms: Iterable[str]) -> str:
    """Terms to an FTS5 query: each quoted, joined with OR."""
    return " OR ".join('"' + t.replace('"', "") + '"' for t in terms)


def fts_query(text: str, max_terms: int = 24) -> str:
    """Free text to an FTS5 query: its content words, each quoted, joined with OR."""
    return terms_query(content_terms(text, max_terms))


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
    live_texts: Iterable[str] = (),
    min_coverage: float = 0.5,
) -> Recall | None:
    """The best-ranked evicted messages for ``text`` whose note fits in ``max_tokens``.

    Only the message's informative words are searched: words the live context (``live_texts``)
    does not already contain, since recalling more about what the model can see adds nothing;
    and words not found in a large share of the evicted messages, since those (a conversation
    about an archive says "archive" everywhere) rank nothing. Each hit must cover at least
    ``min_coverage`` of the searched words' weight (inverse document frequency): a message that
    answers a question contains most of what makes the question specific, while bm25 would add
    up a few shared words of two unrelated long messages to a high score. Messages already
    recalled into the live context (their line is in one of ``live_notes``) are skipped; hits
    are taken in rank order while the note still fits, and only while they score at least
    ``min_relevance`` of the best hit's bm25.
    """
    known = {word for live in live_texts for word in _TOKEN_RE.findall(live.lower())}
    terms = [t for t in content_terms(text, max_terms=64) if t not in known]
    if not terms or max_tokens <= 0:
        return None
    num_messages, frequencies = store.document_frequencies(session_id, terms)
    most = max(COMMON_MIN, int(num_messages * COMMON_SHARE))
    informative = sorted((t for t in terms if 0 < frequencies[t] <= most), key=lambda t: frequencies[t])
    weights = {t: math.log((num_messages + 1) / frequencies[t]) for t in informative[:MAX_QUERY_TERMS]}
    if not weights:
        return None
    total = sum(weights.values())
    chosen: list[SearchHit] = []
    hits = store.search(session_id, terms_query(weights), limit=limit * 4)
    best = hits[0].rank if hits else 0.0  # bm25 in SQLite: more negative is more relevant
    for hit in hits:
        if hit.rank > best * min_relevance:
            break
        words = set(_TOKEN_RE.findall(hit.content.lower()))
        if sum(w for t, w in weights.items() if t in words) < min_coverage * total:
            continue
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


def recall_for_new_message(
    store: Store,
    session_id: str,
    system: str,
    messages: Sequence[MessageRecord],
    max_tokens: int,
    count_tokens: Callable[[str], int],
) -> Recall | None:
    """What :func:`recall_for` finds for the session's new, not yet recalled-for user message
    (None when the last message is not one); nothing is written."""
    chat = [m for m in messages if m.kind == "chat"]
    if not chat or chat[-1].role != "user" or chat[-1].state != "live":
        return None
    new = chat[-1]
    if any(m.kind == "recall" and m.turn == new.turn for m in messages):
        return None  # already recalled (a tool round of the same turn)
    live = [m for m in messages if m.state == "live" and m.id != new.id]
    return recall_for(
        store,
        session_id,
        new.content,
        new.turn,
        max_tokens,
        count_tokens,
        [m.content for m in live if m.kind == "recall"],
        live_texts=[system, *(m.content for m in live if m.kind == "chat")],
    )
