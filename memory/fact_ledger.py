"""The fact ledger: what compacted turns stated, extracted without a model and kept verbatim.

A model-written summary is only as faithful as the model: a 135M model asked to "keep every
name" writes a paragraph about KV caches, and larger models drop details too. So when turns are
compacted, the facts their user and tool messages state (names, numbers with their units, dates
and times, paths, URLs, identifiers in code, quoted strings) are extracted by regular
expressions, deduplicated, and appended to the stored summary text as a "kept verbatim" list
beside the model's prose. The list is bounded by a share of the summary's budget; when it runs
out the oldest facts are folded out of the list (their messages stay in the store, and recall
finds them through the ledger lookup). A fact the prose already states is not repeated.

Extraction reads the messages, never the assistant's replies: a reply's facts are either the
user's, repeated, or the model's own filler. Each fact carries a *cue*, the content words
before it in its clause ("cat" for "my cat is called Pixel"), so that the list reads as
``cat: Pixel`` and the lookup can find the fact by what it is about.
"""

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from memory.lexicon import STOPWORDS, content_words, stem
from memory.records import MessageRecord

LEDGER_HEADER = "Kept verbatim:"
SOURCE_ROLES = ("user", "tool")
# A tool result (a file, a listing) can state hundreds of identifiers; the first few of each
# message keep one large result from pushing everything the user said out of the list.
MAX_FACTS_PER_MESSAGE = 8
MAX_CUE_WORDS = 3
# The most of the summary's share of the budget the kept-verbatim list may take; the model's
# prose keeps the rest, so a conversation full of facts still gets a summary of what happened.
LEDGER_SHARE = 0.5

_MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December|"
    "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
_WEEKDAYS = "Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday"
_UNITS = (
    "%|percent|kg|g|mg|km|m|cm|mm|mi|miles?|ft|feet|inch(?:es)?|lbs?|oz|l|ml|litres?|liters?|"
    "[KMGT]i?B|[kmgt]b|bytes?|tok|tokens?|ms|s|secs?|seconds?|mins?|minutes?|h|hrs?|hours?|days?|"
    "weeks?|months?|years?|usd|eur|gbp|dollars?|euros?|pounds?|°[CF]|degrees?|k?W|V|[MG]Hz|px|x"
)
# (kind, pattern), tried in this order; a span taken by an earlier kind is not matched again.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("url", re.compile(r"\bhttps?://[^\s<>\"'`)\]]+[^\s<>\"'`)\].,;:!?]")),
    ("quoted", re.compile(r"\"([^\"\n]{1,80})\"|“([^”\n]{1,80})”|(?<![\w'])'([^'\n]{1,80})'(?!\w)")),
    ("identifier", re.compile(r"`([^`\n]{1,60})`")),
    (
        "date",
        re.compile(
            rf"\b\d{{4}}-\d{{2}}-\d{{2}}(?:[T ]\d{{1,2}}:\d{{2}})?\b"
            rf"|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b"
            rf"|\b\d{{1,2}}(?:st|nd|rd|th)?(?: of)? (?:{_MONTHS})\b(?:,? \d{{4}}\b)?"
            rf"|\b(?:{_MONTHS})\.? \d{{1,2}}(?:st|nd|rd|th)?\b(?:,? \d{{4}}\b)?"
            rf"|\b(?:{_WEEKDAYS})\b"
            rf"|\b\d{{1,2}}:\d{{2}}(?:\s?(?:[ap]m\b|[ap]\.m\.))?(?![\w:])|\b\d{{1,2}}\s?[ap]m\b"
        ),
    ),
    (
        "path",
        re.compile(
            r"(?<![\w/])(?:~|\.{1,2})?/?(?:[\w.-]+/)+[\w.-]*\w"
            r"|\b[\w-]+\.(?:py|txt|md|json|toml|ya?ml|csv|db|log|sh|js|ts|rs|go|c|h|cpp|html|css|ini"
            r"|cfg|gguf|pdf|png|jpg|ipynb|sql|xml)\b"
        ),
    ),
    (
        "number",
        re.compile(
            rf"(?<![\w.])[$€£]\s?\d[\d,]*(?:\.\d+)?\b"
            rf"|(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:{_UNITS})(?![\w])"
            # bare numbers of three digits or more, or with a decimal part: shorter ones are mostly
            # counts and ordinals of the conversation itself ("part 3", "step 2")
            rf"|(?<![\w.])(?:\d{{3,}}|\d+\.\d+|\d{{1,3}}(?:,\d{{3}})+)(?![\w])"
        ),
    ),
    (
        "identifier",
        re.compile(
            r"\b[A-Za-z_][A-Za-z0-9]*_[A-Za-z0-9_]+\b"  # snake_case
            r"|\b[a-z]+[A-Z][A-Za-z0-9]*\b"  # camelCase
            r"|\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?"  # dotted.names, calls
            r"|\b\w+\(\)"
            r"|(?<![\w-])--?[a-z][\w-]+\b"  # --flags
            r"|\b(?=[\w-]*[A-Za-z])(?=[\w-]*\d)(?!\d+(?:st|nd|rd|th)\b)[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*\b"
            r"|\b[A-Z]{2,}[0-9]*\b"  # acronyms
        ),
    ),
    ("name", re.compile(r"\b[A-Z][a-zà-ÿ]+(?:[-'][A-Z]?[a-zà-ÿ]+)?(?:\s+[A-Z][a-zà-ÿ]+)*\b")),
)
# Capitalized words that are not names: sentence openers, pronouns, interjections, months alone.
_NOT_NAMES = (
    frozenset(
        """i i'm i've i'll i'd ok okay yes no hi hello hey thanks thank sure please note notes dear
    today tomorrow yesterday also however then""".split()
    )
    | STOPWORDS
    | frozenset(m.lower() for m in _MONTHS.split("|"))
)
# Words a cue is better without: the verbs that introduce a name, and politeness.
_CUE_SKIP = frozenset("called named call is remember please note keep".split())
_CLAUSE_END_RE = re.compile(r"[.;:!?,\n()]\s|[.;:!?]$|\band\b|\bbut\b|\bor\b|\n")
_SENTENCE_START_RE = re.compile(r"(?:^|[.!?:]\s+|\n\s*|[\"“(]\s*)$")
_TOOL_WRAPPER_RE = re.compile(r"</?tool_\w+>")


@dataclass(frozen=True, slots=True)
class Fact:
    """One fact as a message stated it, with the words that say what it is about."""

    text: str  # verbatim, as written (quotes and backticks removed)
    kind: str  # name / number / date / path / url / identifier / quoted
    cue: str  # up to three content words of its clause, before it if any ("locker code")
    message_id: int
    turn: int
    context: tuple[str, ...] = ()  # stems of its clause's content words, for the lookup

    @property
    def key(self) -> str:
        return self.text.casefold()

    def line(self) -> str:
        text = f'"{self.text}"' if self.kind == "quoted" else self.text
        return f"{self.cue}: {text}" if self.cue else text

    def stems(self) -> set[str]:
        """What the lookup matches a question against: its clause's stems and its own words'."""
        return set(self.context) | {stem(w) for w in content_words(self.text)}

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("context")
        return record


def _source_text(message: MessageRecord) -> str:
    """The text a message states: a tool result's content without its JSON and wrapper."""
    if message.role != "tool":
        return message.content
    text = _TOOL_WRAPPER_RE.sub("", message.content).strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text
    if isinstance(payload, dict) and isinstance(payload.get("content"), str):
        return str(payload["content"])
    return text


def _clause(text: str, start: int, end: int) -> tuple[str, str]:
    """The parts of the clause around ``text[start:end]`` before and after it."""
    before = text[:start]
    cut = max((m.end() for m in _CLAUSE_END_RE.finditer(before)), default=0)
    after = text[end:]
    stop = _CLAUSE_END_RE.search(after)
    return before[cut:], after[: stop.start() if stop else len(after)]


def _cue(before: str, after: str, facts_text: set[str]) -> tuple[str, tuple[str, ...]]:
    def words(part: str) -> list[str]:
        return [w for w in content_words(part) if w not in facts_text]

    head, tail = words(before), words(after)
    pick = [w for w in head if w not in _CUE_SKIP][-MAX_CUE_WORDS:] or [
        w for w in tail if w not in _CUE_SKIP
    ][:MAX_CUE_WORDS]
    return " ".join(pick), tuple(dict.fromkeys(stem(w) for w in head + tail))


def _is_name(text: str, match: re.Match[str], source: str) -> str | None:
    """The name in a run of capitalized words, or None: a lone word that opens a sentence
    (every sentence starts with a capital) is a name only if the message also writes it
    capitalized where a sentence does not start."""
    words = text.split()
    while words and words[0].lower() in _NOT_NAMES:
        words.pop(0)
    while words and words[-1].lower() in _NOT_NAMES:
        words.pop()
    if not words:
        return None
    name = " ".join(words)
    opens_sentence = _SENTENCE_START_RE.search(source[: match.start()]) is not None
    if opens_sentence and len(words) == 1 and words[0] == text.split()[0]:
        elsewhere = [
            m.start()
            for m in re.finditer(rf"\b{re.escape(name)}\b", source)
            if m.start() != match.start() and not _SENTENCE_START_RE.search(source[: m.start()])
        ]
        if not elsewhere:
            return None
    return name


def extract_facts(message: MessageRecord) -> list[Fact]:
    """The facts ``message`` states, in the order it states them (none for other roles)."""
    if message.role not in SOURCE_ROLES or message.kind != "chat":
        return []
    source = _source_text(message)
    taken: list[tuple[int, int]] = []
    found: list[tuple[int, int, str, str]] = []  # start, end, kind, text
    for kind, pattern in _PATTERNS:
        for match in pattern.finditer(source):
            start, end = match.span()
            if any(start < e and s < end for s, e in taken):
                continue
            text = next((g for g in match.groups() if g), None) if match.groups() else None
            text = (text or match.group(0)).strip()
            if kind == "name":
                text = _is_name(text, match, source) or ""
            if len(text) < 2 and kind != "number":
                continue
            taken.append((start, end))
            found.append((start, end, kind, text))
    found.sort()
    own_words = {w for _, _, _, text in found for w in content_words(text)}
    facts: list[Fact] = []
    seen: set[str] = set()
    for start, end, kind, text in found:
        if text.casefold() in seen:
            continue
        seen.add(text.casefold())
        cue, context = _cue(*_clause(source, start, end), own_words)
        facts.append(Fact(text, kind, cue, message.id, message.turn, context))
        if len(facts) == MAX_FACTS_PER_MESSAGE:
            break
    return facts


def ledger_of(
    messages: Iterable[MessageRecord], extract: Callable[[MessageRecord], list[Fact]]
) -> list[Fact]:
    """The deduplicated facts of ``messages``, oldest first; a fact stated again keeps its first
    statement (its cue says what it was first said about)."""
    facts: list[Fact] = []
    seen: set[str] = set()
    for message in messages:
        for fact in extract(message):
            if fact.key not in seen:
                seen.add(fact.key)
                facts.append(fact)
    return facts


def states(prose: str, fact: Fact) -> bool:
    """Whether ``prose`` already states ``fact`` (its text, whole words, any case)."""
    return re.search(rf"(?<!\w){re.escape(fact.text)}(?!\w)", prose, re.IGNORECASE) is not None


def render_ledger(facts: Sequence[Fact]) -> str:
    return "\n".join([LEDGER_HEADER, *(f"- {f.line()}" for f in facts)]) if facts else ""


def join_summary(prose: str, facts: Sequence[Fact]) -> str:
    """The stored summary text: the model's prose, then the kept-verbatim list."""
    block = render_ledger(facts)
    if not block:
        return prose
    return f"{prose}\n\n{block}" if prose else block


def prose_of(summary: str | None) -> str:
    """The model's prose of a stored summary, without its kept-verbatim list."""
    if not summary:
        return ""
    if summary.startswith(LEDGER_HEADER):
        return ""
    head, _, _ = summary.partition(f"\n\n{LEDGER_HEADER}\n")
    return head


def fit_ledger(facts: Sequence[Fact], max_tokens: int, count: Callable[[str], int]) -> list[Fact]:
    """The newest of ``facts`` whose list fits ``max_tokens``, in their original order: the
    oldest are folded first (out of the list; their messages stay stored and recallable)."""
    if max_tokens <= 0 or not facts:
        return []
    used = count(LEDGER_HEADER + "\n\n")
    kept: list[Fact] = []
    for fact in reversed(facts):
        cost = count(f"- {fact.line()}\n")
        if used + cost > max_tokens:
            break
        kept.append(fact)
        used += cost
    kept.reverse()
    return kept
