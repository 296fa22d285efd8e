"""The small English lexicon memory searches with: stopwords, word forms and a synonym table.

Recall by full-text search finds an evicted turn only through a word the new message shares
with it. The fact ledger's lookup (``memory/recall.py``) also reaches turns that say the same
thing in other words ("my pet" for "my cat"), through two deterministic, offline steps: a
light stemmer that folds word forms onto one stem ("pets", "pet's" → "pet"; "appointments" →
"appointment"), and a table of small synonym groups of what people tell an assistant to
remember (family, pets, credentials, places, dates, work). No model and no download: a group
either holds a word or it does not, so what recall finds can be explained and tested.
"""

import re
from collections.abc import Iterable

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
TOKEN_RE = re.compile(r"[^\W_]+")

# Groups of words that name the same thing in what a user asks an assistant to remember. A word
# may sit in several groups; lookup expands a word to every group that holds it.
SYNONYM_GROUPS: tuple[frozenset[str], ...] = tuple(
    frozenset(group.split())
    for group in (
        "pet cat dog kitten puppy animal parrot hamster rabbit fish",
        "sibling sister brother",
        "parent mother father mom dad mum",
        "child son daughter kid",
        "spouse wife husband partner",
        "relative family cousin aunt uncle niece nephew grandmother grandfather",
        "friend mate buddy colleague coworker",
        "name called named nickname codename alias title",
        "password passphrase passcode pin code secret key",
        "number digits code pin figure",
        "wifi network internet wireless router",
        "cabin lodge cottage chalet hut",
        "house home flat apartment residence",
        "office workplace work job employer company",
        "project plan initiative programme program venture",
        "secret confidential private classified hidden",
        "dentist dental tooth teeth orthodontist",
        "doctor physician gp clinic surgeon",
        "appointment visit checkup meeting booking reservation",
        "date day when time deadline",
        "birthday born birth anniversary",
        "storage locker depot unit warehouse",
        "car vehicle automobile",
        "phone mobile cell telephone",
        "address street location live lives",
        "city town village",
        "email mail inbox",
        "file document path folder directory",
        "favourite favorite preferred best",
        "food meal dish cuisine",
        "drink beverage",
        "colour color",
        "book novel",
        "film movie",
        "song music tune track",
        "boss manager supervisor",
        "school university college",
        "teacher tutor instructor",
        "trip journey holiday vacation travel flight",
        "price cost fee amount budget",
    )
)


def stem(word: str) -> str:
    """``word`` (lower-case) folded onto the stem its common English forms share.

    Deliberately light: possessives, plurals and the regular -ing/-ed forms. Stemming harder
    ("dental" → "dent") would merge words that mean different things.
    """
    if word.endswith("'s") or word.endswith("’s"):
        word = word[:-2]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ches", "shes", "sses", "xes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    if len(word) > 5 and word.endswith("ing"):
        return word[:-3]
    if len(word) > 4 and word.endswith("ed") and not word.endswith("eed"):
        return word[:-2]
    return word


def content_words(text: str) -> list[str]:
    """The content words of ``text``, lower-cased, in order, without stopwords (repeats kept)."""
    return [w for w in TOKEN_RE.findall(text.lower()) if len(w) > 1 and w not in STOPWORDS]


def _synonym_stems() -> dict[str, frozenset[str]]:
    table: dict[str, set[str]] = {}
    for group in SYNONYM_GROUPS:
        stems = {stem(w) for w in group}
        for s in stems:
            table.setdefault(s, set()).update(stems)
    return {s: frozenset(others) for s, others in table.items()}


SYNONYM_STEMS = _synonym_stems()


def expand(words: Iterable[str]) -> dict[str, str]:
    """Every stem ``words`` reach through word forms and synonyms, mapped to the word it came from
    (the first one, when two words reach the same stem)."""
    reached: dict[str, str] = {}
    for word in words:
        base = stem(word)
        reached.setdefault(base, word)
        for other in SYNONYM_STEMS.get(base, ()):
            reached.setdefault(other, word)
    return reached
