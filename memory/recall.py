"""Bringing evicted turns back: full-text search and the fact ledger over what left the live context.

For each new user message the context manager searches the session's summarized and evicted
messages (SQLite FTS5, ranked by bm25) with the message's content words, and puts the best
matches, verbatim and bounded by a share of the budget, into the prompt as a recall note. The
same search is exposed to the agent as its ``recall`` tool.

Full-text search needs a word the new message shares with the old one. So the facts of the
messages that left (``memory/fact_ledger.py``) are looked up too, by the words of each fact's
clause, with the new message's words widened by ``memory/lexicon.py``'s word forms and synonyms:
"what is my pet's name?" reaches "my cat is called Pixel" through pet → cat. Its hits follow the
full-text ones in the note, under the same budget.

The note is placed directly before the message it serves and stays with that turn afterwards.
Placing it ahead of all recent turns, and changing it every turn, would shift every recent turn
and so invalidate the prefix cache for all of them on every request.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from memory.fact_ledger import Fact
from memory.lexicon import STOPWORDS, TOKEN_RE, expand
from memory.records import MessageRecord, SearchHit
from memory.store import Store

_TOKEN_RE = TOKEN_RE
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
    ledger: Sequence[Fact] = (),
    messages: Sequence[MessageRecord] = (),
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

    Then the ``ledger`` (the facts of ``messages`` that left the live context) is looked up
    with the same words (:func:`ledger_hits`), and its hits not already found follow.
    """
    known = {word for live in live_texts for word in _TOKEN_RE.findall(live.lower())}
    terms = [t for t in content_terms(text, max_terms=64) if t not in known]
    if not terms or max_tokens <= 0:
        return None
    candidates = _fts_hits(store, session_id, terms, limit, min_relevance, min_coverage)
    if ledger:
        found = {h.message_id for h in candidates}
        by_id = {m.id: m for m in messages}
        candidates += [
            h for h in ledger_hits(terms, ledger, by_id, min_coverage) if h.message_id not in found
        ]
    chosen: list[SearchHit] = []
    for hit in candidates:
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


def _fts_hits(
    store: Store, session_id: str, terms: list[str], limit: int, min_relevance: float, min_coverage: float
) -> list[SearchHit]:
    """Full-text hits for ``terms``, in rank order, each covering enough of their weight."""
    num_messages, frequencies = store.document_frequencies(session_id, terms)
    most = max(COMMON_MIN, int(num_messages * COMMON_SHARE))
    informative = sorted((t for t in terms if 0 < frequencies[t] <= most), key=lambda t: frequencies[t])
    weights = {t: math.log((num_messages + 1) / frequencies[t]) for t in informative[:MAX_QUERY_TERMS]}
    if not weights:
        return []
    total = sum(weights.values())
    hits = store.search(session_id, terms_query(weights), limit=limit * 4)
    best = hits[0].rank if hits else 0.0  # bm25 in SQLite: more negative is more relevant
    kept: list[SearchHit] = []
    for hit in hits:
        if hit.rank > best * min_relevance:
            break
        words = set(_TOKEN_RE.findall(hit.content.lower()))
        if sum(w for t, w in weights.items() if t in words) >= min_coverage * total:
            kept.append(hit)
    return kept


def ledger_hits(
    terms: Sequence[str],
    ledger: Sequence[Fact],
    messages: dict[int, MessageRecord],
    min_coverage: float = 0.5,
) -> list[SearchHit]:
    """The messages whose facts the question's ``terms`` reach through word forms and synonyms,
    best first (``rank`` is minus the weight covered, as bm25's more negative is better).

    Weighted as the full-text search is: a term reaching many facts (more than
    ``COMMON_SHARE`` of them) ranks nothing and is dropped, one reaching few weighs more, and a
    term reaching none still counts in the total, so a question whose specific words appear
    in no fact ("the name of the river") does not recall a fact through its vague ones
    ("name"). A fact must cover ``min_coverage`` of the total.
    """
    if not ledger or not terms:
        return []
    stems = [fact.stems() for fact in ledger]
    reach = {t: set(expand([t])) for t in terms}
    num_facts = len(ledger)
    reached = {t: sum(1 for s in stems if reach[t] & s) for t in terms}
    most = max(COMMON_MIN, int(num_facts * COMMON_SHARE))
    weights = {
        t: math.log((num_facts + 1) / n) if n else math.log(num_facts + 1)
        for t, n in reached.items()
        if n <= most
    }
    total = sum(weights.values())
    if total <= 0:
        return []
    scored: list[tuple[float, int, int]] = []  # (covered weight, turn, message id)
    for fact, fact_stems in zip(ledger, stems, strict=True):
        covered = sum(w for t, w in weights.items() if reach[t] & fact_stems)
        if covered > 0 and covered >= min_coverage * total:
            scored.append((covered, fact.turn, fact.message_id))
    hits: list[SearchHit] = []
    seen: set[int] = set()
    for covered, _, message_id in sorted(scored, reverse=True):  # best, then most recent
        message = messages.get(message_id)
        if message is None or message_id in seen:
            continue
        seen.add(message_id)
        hits.append(
            SearchHit(message.id, message.turn, message.role, message.content, message.state, -covered)
        )
    return hits


def recall_for_new_message(
    store: Store,
    session_id: str,
    system: str,
    messages: Sequence[MessageRecord],
    max_tokens: int,
    count_tokens: Callable[[str], int],
    ledger: Sequence[Fact] = (),
) -> Recall | None:
    """What :func:`recall_for` finds for the session's new, not yet recalled-for user message
    (None when the last message is not one), ``ledger`` looked up too; nothing is written."""
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
        ledger=ledger,
        messages=messages,
    )
