"""Duplicates and contradictions among long-term facts: what a new fact does to the live ones.

Why: knowledge used to be an append-only FIFO, so "My dog Max comes along." said six times was
six entries, and "I live in Seattle" and a later "I moved to Boston" both reached the prompt.
Each new fact is now compared with the live entries of the same owner (the user's ring, or the
assistant's) and gets one decision:

- ``merge`` into an entry (the same fact again): the entry is strengthened (``strength`` + 1,
  the new pages added to its provenance); no copy is made;
- ``supersede`` an entry (same subject and attribute, another value): the new entry is added,
  the old one stops being live and keeps its validity interval (``valid_to``,
  ``superseded_by``), so retrieval and the prompt see the newer one and history shows both;
- ``add``: a new entry;
- ``outdated``: it was said before a value already known (a segment promoted late brings an
  older statement): it is kept as history only, in its place on the attribute's timeline
  (superseded by the later value, ending the one before it).

Facts are decided in the order of their source pages' times, so "I live in Seattle" and "I
moved to Boston" promoted in one batch, or in the wrong order, still leave Boston live.

In LLM mode the promotion call decides (add / update / ignore against the entries it was
shown, as O-Mem manages persona attributes); otherwise, and for facts the LLM gave no decision
for, the deterministic rule here decides: a normalised (attribute, value) key read from the
sentence (:func:`fact_key`), then embedding similarity (>= ``memory.fact_duplicate_cos`` with
the owner's nearest live entry, one kernel call for the whole batch).
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass

#: Words that end a value ("I moved to Boston last month" -> "boston").
_VALUE_END = (
    r"(?=\s+(?:last|this|next|in|on|at|for|since|because|with|and|but|now|so|yesterday|today|"
    r"recently|again|ago|these|nowadays|anymore|permanently)\b|[.,;:!?]|$)"
)
_VALUE = r"(?P<v>[^.,;:!?]{1,60}?)" + _VALUE_END
_PETS = r"dog|cat|puppy|kitten|parrot|hamster|rabbit|bunny|fish|turtle|horse|pet"

# The attribute rule as data. Two sentence shapes state an attribute of the speaker:
#
# - the speaker as subject, then a verb phrase: "I (have|'m|now|just ...) <phrase> <value>";
#   only the speaker ("I", "we": a household, "the user": an LLM's third person) counts, so
#   "my sister lives in Boston" states nothing about where the user lives;
# - the speaker's possession: "my|our|the user's <phrase> <value>".
#
# Each attribute lists its phrases in both shapes; a key groups the ways of saying one attribute
# ("live in", "moved to", "relocated to" are all the residence). Phrases are chosen for what they
# mean (they state the current value of a single-valued attribute), not to fit a test set: the
# benchmark's held-out phrasings (benchmarks/conflicts.py) are deliberately absent. Left out on
# purpose: future and hypothetical forms ("want to move to"), the past ("used to live in"),
# negation ("don't live in": the aux list has no "not"), indefinite pets ("we got a cat called
# Luna" may be a second cat, not a new name).
_SPEAKER = r"\b(?:i|we|the user)"
_AUX = (
    r"(?:'m|'ve|'re|\s+(?:am|are|is|have|has|had|just|now|recently|finally|officially|"
    r"currently|also|then|since|eventually|actually))*"
)
#: attributes whose value may follow an article ("I work as a nurse"); elsewhere an article
#: means no name ("I moved to a new flat", "I got a job at a startup" give no value)
_ARTICLE_BEFORE = {"job"}

#: attribute -> verb phrases after the speaker, " | " between them (the value follows)
SUBJECT_PHRASES: dict[str, str] = {
    "residence": (
        "live in | lives in | living in | reside in | resides in | residing in | moved to | "
        "moved back to | moved over to | moved house to | moves to | relocated to | "
        "relocated back to | settled in | settled down in | based in | made the move to"
    ),
    "job": (
        "work as | works as | working as | started working as | started work as | "
        "employed as | hired as | got hired as | got a job as | took a job as | "
        "started a new job as | started a job as | got a new job as | became | become | "
        "retrained as | qualified as"
    ),
    "employer": (
        "work at | work for | works at | works for | working at | working for | employed at | "
        "employed by | hired by | got hired by | got hired at | got a job at | "
        "got a job with | got a new job at | took a job at | took a job with | "
        "started working at | started working for | started a new job at"
    ),
}

#: attribute -> (nouns after "my" / "our" / "the user's", the word between "is" and the value)
POSSESSION_PHRASES: dict[str, tuple[tuple[str, ...], str]] = {
    "residence": (("home", "house", "place", "flat", "apartment"), "in"),
    "job": (("job", "profession", "occupation", "role", "job title", "day job"), ""),
    "employer": (("employer", "workplace"), ""),
}

#: values that name no place, job or employer ("I moved to a new flat", "I work for myself
#: and ..." stay unkeyed: they say something else than the attribute's value)
_NOT_A_VALUE = re.compile(
    r"^(?:a|an|my|our|his|her|their|this|that|some|home|here|there|myself|at|for|with)\b"
)

# A pet's name is the capitalised word (the rest of the pattern ignores case): the connectors
# between "my dog" and its name, and the sentences that give a pet a name.
PET_NAME_CONNECTORS = (
    "'s name is | 's name is now | is called | is named | is now called | is now named | "
    "named | called | goes by | ,"
)
PET_NAMING_VERBS = "renamed | named | call | called"


def _listed(items: str | tuple[str, ...]) -> tuple[str, ...]:
    """Literal phrases given as a tuple, or as one string with " | " between them."""
    return tuple(items.split(" | ")) if isinstance(items, str) else items


def _phrases(items: str | tuple[str, ...]) -> str:
    """One alternation of literal phrases, longest first (so "moved back to" beats "moved
    to")."""
    return "|".join(
        re.escape(p).replace(r"\ ", r"\s+") for p in sorted(_listed(items), key=len, reverse=True)
    )


def _article(key: str) -> str:
    return r"(?:an?\s+)?" if key in _ARTICLE_BEFORE else ""


def _subject_rule(key: str, phrases: str) -> re.Pattern[str]:
    return re.compile(
        _SPEAKER + _AUX + r"\s+(?:" + _phrases(phrases) + r")\s+" + _article(key) + _VALUE,
        re.IGNORECASE,
    )


def _possession_rule(key: str, nouns: tuple[str, ...], linker: str) -> re.Pattern[str]:
    link = rf"\s+{linker}" if linker else ""
    return re.compile(
        r"\b(?:my|our|the user's)\s+(?:"
        + _phrases(nouns)
        + r")(?:\s+is|'s)(?:\s+now)?"
        + link
        + r"\s+"
        + _article(key)
        + _VALUE,
        re.IGNORECASE,
    )


# (attribute key, pattern), built from the tables; the first pattern that matches decides
_RULES: list[tuple[str, re.Pattern[str]]] = [
    *((k, _subject_rule(k, v)) for k, v in SUBJECT_PHRASES.items()),
    *((k, _possession_rule(k, *v)) for k, v in POSSESSION_PHRASES.items()),
]
_OWNER = r"(?i:my|our|the user's)"
_PET = r"(?P<pet>(?i:" + _PETS + r"))"
_NAME = r"(?P<v>[A-Z][a-z]+)\b"
_PET_RULES = [
    # "renamed our dog Rex", "we named our cat Luna", "we call our dog Max"
    re.compile(
        r"\b(?i:"
        + _phrases(PET_NAMING_VERBS)
        + r")\s+"
        + _OWNER
        + r"\s+"
        + _PET
        + r"\s+(?i:to\s+)?"
        + _NAME
    ),
    # "my dog is called Max", "my cat's name is Luna", "my dog Max comes along"
    re.compile(
        r"\b"
        + _OWNER
        + r"\s+(?i:new\s+)?"
        + _PET
        + r"(?i:\s*(?:"
        + _phrases(PET_NAME_CONNECTORS)
        + r"))?\s+(?i:now\s+)?"
        + _NAME
    ),
]
# "my X is Y" only for attributes that hold one value at a time ("my brother is tall" and "my
# brother is a doctor" are two facts, "my favourite colour is green" replaces "... is blue")
_GENERIC = re.compile(
    r"\b(?:my|the user's) (?P<a>favou?rite [a-z]+(?: [a-z]+)?|name|age|birthday|email|phone "
    r"number|address|height|weight|partner's name|wife's name|husband's name) is(?: now)?\s+"
    + _VALUE,
    re.IGNORECASE,
)
_PLAIN = re.compile(r"[^a-z0-9 ]+")


def _trigger_words() -> list[str]:
    """The words one of which every rule's match holds, each after whitespace: a pet (both pet
    rules), a subject phrase's first word, a possessed noun, a generic attribute's first
    word."""
    firsts = [p.split()[0] for v in SUBJECT_PHRASES.values() for p in _listed(v)]
    nouns = [n.split()[0] for nouns, _ in POSSESSION_PHRASES.values() for n in nouns]
    generic = "favorite favourite name age birthday email phone address height weight partner"
    return sorted({*_PETS.split("|"), *firsts, *nouns, *generic.split(), "wife", "husband"})


# Most facts state no attribute the rules know (none of LoCoMo's 1,516 first-person sentences
# does), and trying every rule on one cost ~20 us. A rule can only match where one of its
# words starts after whitespace, so one search for those words first decides for most of them.
# It runs on the text with re.IGNORECASE's ASCII equivalents made plain (dotless and dotted
# I, long s, the Kelvin sign) and lower-cased, so it never misses a word a rule would match.
_TRIGGERS = re.compile(
    r"(?<!\S)(?:" + "|".join(sorted(_trigger_words(), key=len, reverse=True)) + ")"
)
_ASCII_EQUIVALENTS = str.maketrans({"\u0131": "i", "\u0130": "i", "\u017f": "s", "\u212a": "k"})


def _norm(text: str) -> str:
    return " ".join(_PLAIN.sub(" ", text.lower()).split())


@functools.lru_cache(maxsize=1 << 16)  # pure; the rule re-keys the entries it compares with
def fact_key(text: str) -> tuple[str, str] | None:
    """The (attribute key, normalised value) a fact states, or None when it states no single
    attribute the rule knows ("I moved to Boston." -> ("residence", "boston"); "My dog is
    called Rex." -> ("dog.name", "rex"); "My favourite colour is blue" -> ("favourite colour",
    "blue"); "my X is Y" counts only for attributes with one value at a time). Deterministic:
    the same sentence always gives the same key."""
    if not _TRIGGERS.search(text.translate(_ASCII_EQUIVALENTS).lower()):
        return None
    return _rules_key(text)


def _rules_key(text: str) -> tuple[str, str] | None:
    """:func:`fact_key` by the rules alone, every one tried."""
    for pattern in _PET_RULES:
        m = pattern.search(text)
        if m:
            return f"{m.group('pet').lower()}.name", m.group("v").lower()
    for key, pattern in _RULES:
        m = pattern.search(text)
        value = _norm(m.group("v")) if m else ""
        if value and not _NOT_A_VALUE.match(value):
            return key, value
    m = _GENERIC.search(text)
    if m and _norm(m.group("v")):
        return _norm(m.group("a")), _norm(m.group("v"))
    return None


@dataclass(frozen=True)
class Decision:
    """What one new fact does: ``action`` is ``add``, ``merge``, ``supersede`` or
    ``outdated``; ``target`` the entry merged into, superseded, or superseding it (an entry
    id, or ``-(i + 1)`` for the i-th fact of the same batch that was added)."""

    action: str
    target: int | None = None
    before: int | None = None  # outdated: the entry that held before it, which it now ends


@dataclass
class LiveEntry:
    """An entry the rule compares against (live, or superseded history): its owner slot, its
    (key, value) and since when it held."""

    owner: int
    key: tuple[str, str] | None
    since: float = 0.0
    live: bool = True


def decide(
    owners: list[int],
    keys: list[tuple[str, str] | None],
    times: list[float],
    nearest: list[tuple[int, float]],
    live: dict[int, LiveEntry],
    same_batch: list[list[tuple[int, float]]],
    threshold: float,
) -> list[Decision]:
    """The deterministic rule for a batch of facts, in order (the caller sorts them by time).

    ``owners[i]``: fact i's owner slot; ``keys[i]``: its :func:`fact_key`; ``times[i]``: when
    it was said; ``nearest[i]``:
    (entry id, cosine) of the owner's most similar live entry (id < 0: none); ``live``: the
    owners' live entries that have a key, plus the nearest ones; ``same_batch[i]``: (j,
    cosine) for the earlier facts j < i of the same owner (those under ``threshold`` may be
    left out: they never merge). A key decides first (same value:
    merge; another value: supersede); otherwise a cosine >= ``threshold`` with an entry whose
    key does not differ merges.
    """
    out: list[Decision] = []
    # (owner, attribute) -> its timeline: [since, entry, value], oldest first (live + history)
    lines: dict[tuple[int, str], list[tuple[float, int, str]]] = {}
    for eid, e in live.items():
        if e.key is not None:
            lines.setdefault((e.owner, e.key[0]), []).append((e.since, eid, e.key[1]))
    for line in lines.values():
        line.sort()
    added: dict[int, tuple[str, str] | None] = {}  # fact index -> its key, for facts added
    for i, (owner, key) in enumerate(zip(owners, keys, strict=True)):
        line = lines.setdefault((owner, key[0]), []) if key is not None else None
        decision = _by_key(line, key, times[i]) or _by_similarity(
            key, nearest[i], live, same_batch[i], added, threshold
        )
        out.append(decision)
        if decision.action != "merge":
            added[i] = key
            if line is not None:
                bisect.insort(line, (times[i], -(i + 1), key[1]))
    return out


def _by_key(
    line: list[tuple[float, int, str]] | None, key: tuple[str, str] | None, at: float
) -> Decision | None:
    """The attribute's timeline decides: the value that held when the fact was said is the
    same (merge), or it changed then (supersede the live one, or -- when a later value is
    known already -- slot in as history: ``outdated``, superseded by that later value, and
    ending the one before it)."""
    if not line or key is None:
        return None
    at_pos = bisect.bisect_right(line, (at, float("inf"), ""))
    held = line[at_pos - 1] if at_pos else None
    if held is not None and held[2] == key[1]:
        return Decision("merge", held[1])
    if at_pos == len(line):
        return Decision("supersede", line[-1][1])
    return Decision("outdated", line[at_pos][1], held[1] if held is not None else None)


def _by_similarity(
    key: tuple[str, str] | None,
    nearest: tuple[int, float],
    live: dict[int, LiveEntry],
    same_batch: list[tuple[int, float]],
    added: dict[int, tuple[str, str] | None],
    threshold: float,
) -> Decision:
    eid, cos = nearest  # always a live entry (the kernel reads the rings)
    best: tuple[float, int] | None = None
    if eid >= 0 and cos >= threshold and _compatible(key, live.get(eid, LiveEntry(-1, None)).key):
        best = (cos, eid)
    for j, c in same_batch:
        fits = j in added and c >= threshold and _compatible(key, added[j])
        if fits and (best is None or c > best[0]):
            best = (c, -(j + 1))
    return Decision("merge", best[1]) if best is not None else Decision("add")


def _compatible(a: tuple[str, str] | None, b: tuple[str, str] | None) -> bool:
    """Two facts may be one when neither states an attribute or both state the same value."""
    return a is None or b is None or a == b
