"""LLM-free keyword extraction and stable keyword hashing.

Used in two places:

* the arena kernels compare segment / page / query keyword sets by Jaccard over
  *hashed* keyword ids (``int32``, sorted, unique, padded with ``-1``);
* retrieval quality: LoCoMo questions hinge on names, dates and rare words, so
  the extractor ranks by ``tf * idf`` with boosts for proper nouns and
  numbers / dates.

Normalisation (applied identically to page keywords, query keywords and before
hashing, so ids always agree):

* Unicode NFKC, then ``casefold`` (lower case), then NFKC again
  (:func:`memoryos_gpu.text.words.normalise`);
* word tokens are runs of letters/digits and their combining marks (``_`` is a
  separator), and the overlapping letter pairs of scripts written without spaces
  (:mod:`memoryos_gpu.text.words`); an apostrophe inside a word is kept only for
  contractions, a trailing possessive ``'s`` / ``'`` is stripped ("Caroline's" -> "caroline");
* digits are kept ("2023", "7pm", "3d");
* a built-in English stopword list is removed (pass ``stopwords=`` to change), and a text
  written in another language loses that language's stopwords too, the language found per
  text (:mod:`memoryos_gpu.text.stopword_lists`; pass ``language_stopwords=`` to change);
* plural folding (``fold_plurals=True``) is OFF by default. It is a crude
  suffix rule ("cats" -> "cat", "stories" -> "story", never touching words of
  4 characters or fewer or words ending in "ss"/"us"/"is"). It is not measured
  here; whoever turns it on must use the same setting for pages and queries.

Keywords are single tokens (unigrams), never phrases: hashed unigram sets give
Jaccard overlap between a query and a page even when phrases differ.

Hashing uses ``blake2b`` (8-byte digest, little-endian) truncated to 31 bits, so
ids are non-negative ``int32`` values that are identical in every process and
on every machine; ``-1`` is therefore free as the padding value. Python's
``hash()`` is never used (it is salted per process).
"""

from __future__ import annotations

import functools
import hashlib
import math
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from memoryos_gpu.text.stopword_lists import language_stopwords
from memoryos_gpu.text.words import normalise
from memoryos_gpu.text.words import words as split_words

__all__ = [
    "PAD_ID",
    "STOPWORDS",
    "KeywordExtractor",
    "extract_yake",
    "hash_keyword",
    "hash_keywords",
    "jaccard",
    "jaccard_ids",
    "keyword_tokens",
    "language_of",
    "normalize_word",
    "pack_keywords",
    "tokenize",
    "unpack_keywords",
    "yake_available",
]

#: Padding value in packed keyword-id matrices (real ids are >= 0).
PAD_ID: int = -1

_HASH_MASK = 0x7FFFFFFF


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# A compact English stopword list: function words, auxiliaries, pronouns,
# chat filler. Content words (even frequent ones) are left to IDF.
STOPWORDS: frozenset[str] = _words(
    """
    a about above after again against ago all almost also although always am an
    and another any anyone anything anyway anywhere are aren around as at away
    be became because become been before being below besides between both but by
    can cannot could couldn did didn do does doesn doing don done down during
    each either else enough etc even ever every everyone everything
    few for from further get gets getting go goes going gone got gotta
    had hadn has hasn have haven having he her here hers herself him himself his
    how however i if in into is isn it its itself just
    let lets like ll maybe me might mine more most much must mustn my myself
    neither never no nor not nothing now of off often oh ok okay on once one only
    or other others otherwise our ours ourselves out over own
    per perhaps please quite rather re really
    s same shall she should shouldn since so some someone something sometimes
    somewhat soon still such sure
    t than that thats the their theirs them themselves then there these they
    thing things this those though through thus to too toward towards
    u under until up upon us
    ve very via was wasn we well were weren what whatever when whenever where
    whereas wherever whether which while who whoever whom whose why will with
    within without won would wouldn yeah yes yet you your yours yourself
    yourselves
    hi hello hey thanks thank wow um uh hmm haha lol
    im ive id youre youve youd youll hes shes theyre theyve weve
    dont doesnt didnt cant couldnt wont wouldnt shouldnt isnt arent wasnt
    werent hasnt havent hadnt thats theres whats lets
    """
)

_MONTHS = _words(
    """
    january february march april may june july august september october november
    december jan feb mar apr jun jul aug sep sept oct nov dec
    """
)
_WEEKDAYS = _words(
    """
    monday tuesday wednesday thursday friday saturday sunday
    mon tue tues wed thu thur thurs fri sat sun
    """
)
# Ambiguous month / weekday abbreviations that are also ordinary words; they
# get the date boost only when capitalised in the source text.
_AMBIGUOUS_DATE = frozenset({"may", "mar", "sat", "sun", "wed", "jan", "dec"})


def _nfkc(text: str) -> str:
    return text if text.isascii() else unicodedata.normalize("NFKC", text)  # ASCII: NFKC already


def _fold_plural(tok: str) -> str:
    if len(tok) <= 4 or tok[-1] != "s" or tok.isdigit():
        return tok
    if tok.endswith(("ss", "us", "is")):
        return tok
    if tok.endswith("ies") and len(tok) > 5:
        return tok[:-3] + "y"
    if tok.endswith(("ches", "shes", "xes", "zes", "sses")):
        return tok[:-2]
    return tok[:-1]


def _strip_apostrophes(word: str) -> str:
    """Drop a possessive ``'s``/trailing apostrophe; keep contractions joined."""
    word = word.replace("\u2019", "'")
    if word.endswith("'s"):
        word = word[:-2]
    # "don't" -> "dont", "o'neil" -> "oneil": one token, no apostrophe.
    return word.replace("'", "")


def _in_word(ch: str) -> bool:
    """A letter, digit or combining mark: what a word keeps when it is normalised."""
    return ch.isalnum() or unicodedata.category(ch)[0] == "M"


def normalize_word(word: str, *, fold_plurals: bool = False) -> str:
    """Normalise one keyword exactly as :func:`tokenize` does (no stopword test).

    Returns ``""`` for input with no letters/digits. Multi-token input is joined
    without separators only through apostrophes; other separators are dropped,
    e.g. ``"New-York"`` -> ``"newyork"``. Callers that start from raw text
    should use :func:`tokenize` instead.
    """
    w = _strip_apostrophes(normalise(word.strip()))
    w = w if w.isascii() and w.isalnum() else "".join(ch for ch in w if _in_word(ch))
    if fold_plurals:
        w = _fold_plural(w)
    return w


def _norm_tokens(text: str) -> list[str]:
    """The normalised tokens of ``text`` without surface forms or sentence positions: the text
    is NFKC-normalised and case-folded as a whole, then split into words. The native splitter
    of the lexical index (``csrc/host/terms.cpp``) does exactly this for whole batches, so a
    word has one id in both."""
    out = []
    for norm in split_words(normalise(text or "")):
        if "'" in norm or "\u2019" in norm:
            norm = _strip_apostrophes(norm)
        if norm:
            out.append(norm)
    return out


def tokenize(
    text: str,
    *,
    stopwords: Iterable[str] | None = None,
    drop_stopwords: bool = True,
    fold_plurals: bool = False,
    min_len: int = 1,
) -> list[str]:
    """Lower-case word tokens of ``text`` in order (duplicates kept).

    Digits are kept; possessive ``'s`` stripped; stopwords (built-in list or
    ``stopwords``) removed unless ``drop_stopwords=False``; tokens shorter than
    ``min_len`` characters dropped (single digits are always kept: "3 kids").
    """
    sw = STOPWORDS if stopwords is None else frozenset(stopwords)
    toks: list[str] = []
    for norm in _norm_tokens(text):
        if drop_stopwords and norm in sw:
            continue
        if len(norm) < min_len and not norm.isdigit():
            continue
        if fold_plurals:
            norm = _fold_plural(norm)
        toks.append(norm)
    return toks


def language_of(words: Sequence[str]) -> frozenset[str]:
    """The stopwords of the language other than English that ``words`` (the normalised words
    of one text, stopwords included) are written in, or an empty set: the native scanner's
    rule (``csrc/include/memoryos/keywords.h``; :mod:`~memoryos_gpu.text.stopword_lists`), for
    the texts that do not go through it (an LLM's keyword phrases). Its list holds the most
    of the words (the first of equals), at least two, and more than the English list."""
    lists = language_stopwords()
    hits = [sum(w in stop for w in words) for stop in lists.values()]
    best = max(range(len(hits)), key=lambda b: (hits[b], -b), default=None)
    if best is None or hits[best] < 2 or hits[best] <= sum(w in STOPWORDS for w in words):
        return frozenset()
    return list(lists.values())[best]


def keyword_tokens(
    keywords: Iterable[str],
    *,
    max_tokens: int | None = None,
    fold_plurals: bool = False,
) -> list[str]:
    """Split (LLM-written) keyword phrases into ranked, unique, normalised tokens.

    ``["support group", "Caroline's", "LGBTQ"]`` -> ``["support", "group",
    "caroline", "lgbtq"]``. Order follows the input (best first); stopwords are
    dropped, and the stopwords of the phrases' language when they are written in another
    (``["la plage", "cours de piano"]`` -> ``["plage", "cours", "piano"]``: the scanner's rule,
    :func:`language_of`, over the list's words). Use this before :func:`hash_keywords` /
    :func:`pack_keywords`, which treat each entry as ONE word (a phrase would be squashed into
    one token).
    """
    words = [_norm_tokens(p) if isinstance(p, str) else [] for p in keywords]
    foreign = language_of([w for ws in words for w in ws])
    out: list[str] = []
    seen: set[str] = set()
    for ws in words:
        for norm in ws:
            if norm in STOPWORDS or norm in foreign:
                continue
            tok = _fold_plural(norm) if fold_plurals else norm
            if tok not in seen:
                seen.add(tok)
                out.append(tok)
                if max_tokens is not None and len(out) >= max_tokens:
                    return out
    return out


#: Flag bits of the native scanner's candidates (``csrc/include/memoryos/keywords.h``).
_F_PROPER, _F_CAPITAL_INITIAL, _F_DATE_WORD, _F_AMBIGUOUS_DATE = 1, 2, 4, 8


@functools.cache
def _scanner(
    stopwords: frozenset[str],
    languages: tuple[frozenset[str], ...],
    min_len: int,
    fold_plurals: bool,
) -> Any:
    from memoryos_gpu import _C

    return _C.KeywordScanner(
        sorted(stopwords),
        sorted(_MONTHS | _WEEKDAYS),
        sorted(_AMBIGUOUS_DATE),
        min_len,
        fold_plurals,
        [sorted(words) for words in languages],
    )


def _nfkc_joined(texts: Sequence[str]) -> str:
    """The batch NFKC-normalised and joined by U+0000 (the scanner's document separator; a
    U+0000 inside a text is read as a space). Only the texts that are not ASCII are
    normalised, each on its own: a U+0000 neither composes nor decomposes, so that is the
    normalisation of the joined batch, without a pass over the ASCII ones (most of them)."""
    joined = "\x00".join(t or "" for t in texts)
    if joined.isascii() and joined.count("\x00") == max(0, len(texts) - 1):
        return joined
    return "\x00".join(_nfkc((t or "").replace("\x00", " ")) for t in texts)


@dataclass(frozen=True)
class Candidates:
    """The candidate keywords of a batch of texts (CSR): text i's are
    ``words[offsets[i]:offsets[i+1]]`` in order of first occurrence, with their
    :func:`hash_keyword` ids and extractor scores."""

    words: list[str]
    offsets: np.ndarray  # int64 [n + 1]
    ids: np.ndarray  # int32
    scores: np.ndarray  # float64


class KeywordExtractor:
    """Incremental ``tf * idf`` keyword extractor with proper-noun / date boosts.

    Document frequencies are maintained incrementally: :meth:`update` adds
    documents (one document = one text, counted once per distinct token),
    :meth:`fit` resets and then adds. Keep one instance per user for per-user
    IDF, or one global instance; the class does not care.

    Scoring of a token ``w`` in the text being analysed::

        score(w) = tf(w) * idf(w) * boost(w)
        idf(w)   = ln((1 + N) / (1 + df(w))) + 1          # smooth, always >= 1
        boost(w) = proper_noun_boost   if seen capitalised not at a sentence start
                                          (or as an ACRONYM anywhere)
                 * number_boost        if it contains a digit, or is a month /
                                          weekday name (ambiguous ones such as
                                          "may" only when capitalised)

    With no documents seen (``N = 0``) every idf is 1 and ranking is by tf and
    boosts only. The text being analysed is NOT added to the statistics by
    :meth:`extract`; call :meth:`update` for that. Ties are broken by first
    occurrence in the text (then alphabetically), so results are deterministic.
    """

    def __init__(
        self,
        *,
        stopwords: Iterable[str] | None = None,
        language_stopwords: Mapping[str, Iterable[str]] | None = None,
        proper_noun_boost: float = 2.0,
        number_boost: float = 1.5,
        min_len: int = 2,
        fold_plurals: bool = False,
    ) -> None:
        self.stopwords = STOPWORDS if stopwords is None else frozenset(stopwords)
        #: other languages' stopwords by language, in the order ties go (a text's own
        #: language found per text: ``stopword_lists``); None: the bundled lists
        self.language_stopwords: dict[str, frozenset[str]] | None = (
            None
            if language_stopwords is None
            else {str(k): frozenset(v) for k, v in language_stopwords.items()}
        )
        self.proper_noun_boost = float(proper_noun_boost)
        self.number_boost = float(number_boost)
        self.min_len = int(min_len)
        self.fold_plurals = bool(fold_plurals)
        self.df: Counter[str] = Counter()
        self.n_docs = 0

    # ---------------------------------------------------------------- stats
    def fit(self, corpus_texts: Iterable[str]) -> KeywordExtractor:
        """Reset the document statistics and learn them from ``corpus_texts``."""
        self.df = Counter()
        self.n_docs = 0
        return self.update(corpus_texts)

    def update(self, corpus_texts: Iterable[str] | str) -> KeywordExtractor:
        """Add documents to the statistics (a single ``str`` is one document)."""
        texts = [corpus_texts] if isinstance(corpus_texts, str) else list(corpus_texts)
        self.df.update(self._scan(texts)[4])  # a document's candidates are distinct: C-level count
        self.n_docs += len(texts)
        return self

    def remove(self, corpus_texts: Iterable[str]) -> KeywordExtractor:
        """Take documents added before back out of the statistics (their pages were deleted):
        a token no document holds any more is dropped, so the saved state does not keep it."""
        texts = list(corpus_texts)
        words = self._scan(texts)[4]
        self.df.subtract(words)
        for tok in set(words):
            if self.df[tok] <= 0:
                del self.df[tok]
        self.n_docs = max(0, self.n_docs - len(texts))
        return self

    def idf(self, token: str) -> float:
        """Smoothed inverse document frequency of a normalised token."""
        return math.log((1.0 + self.n_docs) / (1.0 + self.df.get(token, 0))) + 1.0

    # ------------------------------------------------------------ extraction
    def _scan(self, texts: Sequence[str], *, with_ids: bool = False) -> tuple:
        """The native scanner's candidates of ``texts`` (``csrc/host/keywords.cpp``): offsets,
        ids (``with_ids``: of ASCII words), tf, flags, words."""
        languages = (
            language_stopwords() if self.language_stopwords is None else self.language_stopwords
        )
        scanner = _scanner(
            self.stopwords, tuple(languages.values()), self.min_len, self.fold_plurals
        )
        return scanner.scan(_nfkc_joined(texts), len(texts), with_ids)

    def candidates(self, texts: Sequence[str]) -> Candidates:
        """Every candidate keyword of each text with its ``tf * idf * boost`` score: one native
        scan for the batch, the scores vectorised (the only per-word Python is the lookup of
        each word's document frequency, done by C-level ``map``)."""
        offsets, ids, tf, flags, words = self._scan(texts, with_ids=True)
        other = np.flatnonzero(ids < 0)  # non-ASCII words: the exact hash_keyword id
        if other.size:
            ids[other] = np.fromiter((hash_keyword(words[i]) for i in other), np.int32, other.size)
        df = np.fromiter(map(self.df.get, words, repeat(0)), np.float64, len(words))
        idf = np.log((1.0 + self.n_docs) / (1.0 + df)) + 1.0
        proper = (flags & _F_PROPER) != 0
        capital_initial = (flags & _F_CAPITAL_INITIAL) != 0
        dated = ((flags & _F_DATE_WORD) != 0) & (
            ((flags & _F_AMBIGUOUS_DATE) == 0) | proper | capital_initial
        )
        boost = np.where(proper, self.proper_noun_boost, 1.0) * np.where(
            dated, self.number_boost, 1.0
        )
        return Candidates(words, offsets, ids, tf.astype(np.float64) * idf * boost)

    def scores(self, text: str) -> dict[str, float]:
        """Score of every candidate keyword in ``text``, in order of first occurrence."""
        c = self.candidates([text])
        return dict(zip(c.words, c.scores.tolist(), strict=True))

    def extract(self, text: str, top_n: int = 8) -> list[str]:
        """Up to ``top_n`` normalised keywords of ``text``, best first."""
        return self.extract_many([text], top_n=top_n)[0]

    def extract_many(self, texts: Sequence[str], top_n: int = 8) -> list[list[str]]:
        """Each text's best ``top_n`` keywords by score (ties: first occurrence), one sort for
        the whole batch."""
        c = self.candidates(texts)
        sizes = np.diff(c.offsets)
        group = np.repeat(np.arange(len(texts)), sizes)
        position = np.arange(c.ids.size) - np.repeat(c.offsets[:-1], sizes)
        order = np.lexsort((position, -c.scores, group))
        rank = np.arange(order.size) - c.offsets[:-1][group[order]]
        out: list[list[str]] = [[] for _ in texts]
        for j in order[rank < max(0, top_n)].tolist():
            out[group[j]].append(c.words[j])
        return out

    # ---------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (settings + document frequencies)."""
        return {
            "n_docs": self.n_docs,
            "df": dict(self.df),
            "proper_noun_boost": self.proper_noun_boost,
            "number_boost": self.number_boost,
            "min_len": self.min_len,
            "fold_plurals": self.fold_plurals,
            "stopwords": None if self.stopwords is STOPWORDS else sorted(self.stopwords),
            "language_stopwords": None
            if self.language_stopwords is None
            else {k: sorted(v) for k, v in self.language_stopwords.items()},
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> KeywordExtractor:
        ex = cls(
            stopwords=state.get("stopwords"),
            language_stopwords=state.get("language_stopwords"),
            proper_noun_boost=state.get("proper_noun_boost", 2.0),
            number_boost=state.get("number_boost", 1.5),
            min_len=state.get("min_len", 2),
            fold_plurals=state.get("fold_plurals", False),
        )
        ex.df = Counter({str(k): int(v) for k, v in state.get("df", {}).items()})
        ex.n_docs = int(state.get("n_docs", 0))
        return ex


def yake_available() -> bool:
    try:
        import yake  # noqa: F401
    except ImportError:
        return False
    return True


def extract_yake(text: str, top_n: int = 8, *, language: str = "en") -> list[str]:
    """Alternative extractor using YAKE (unigrams), normalised like :func:`tokenize`.

    Raises ``ImportError`` (``pip install yake``) when yake is not installed.
    Stopwords of this module are filtered from the output.
    """
    try:
        import yake
    except ImportError as exc:  # pragma: no cover - depends on environment
        raise ImportError("extract_yake needs the 'yake' package: pip install yake") from exc
    if top_n <= 0 or not (text or "").strip():
        return []
    kw = yake.KeywordExtractor(lan=language, n=1, top=max(top_n * 2, top_n + 4))
    out: list[str] = []
    seen: set[str] = set()
    for phrase, _score in kw.extract_keywords(text):
        for tok in tokenize(phrase):
            if tok not in seen:
                seen.add(tok)
                out.append(tok)
        if len(out) >= top_n:
            break
    return out[:top_n]


# ------------------------------------------------------------------ hashing
@functools.lru_cache(maxsize=1 << 16)
def hash_keyword(word: str) -> int:
    """Stable 31-bit id of one keyword (after :func:`normalize_word`); -1 if empty. Cached:
    a conversation repeats its words, and every written page and query hashes its keywords."""
    w = normalize_word(word)
    if not w:
        return PAD_ID
    digest = hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _HASH_MASK


def hash_keywords(words: Iterable[str]) -> np.ndarray:
    """Sorted, unique ``int32`` ids of ``words`` (empty words are skipped)."""
    ids = {hash_keyword(w) for w in words}
    ids.discard(PAD_ID)
    return np.array(sorted(ids), dtype=np.int32)


def pack_keywords(list_of_word_lists: Sequence[Sequence[str]], width: int) -> np.ndarray:
    """Pack keyword lists into an ``int32 [n, width]`` matrix padded with ``-1``.

    Each input list is taken to be ranked best-first. Words are normalised and
    de-duplicated (first occurrence wins); if more than ``width`` distinct words
    remain, the list is truncated to its first ``width`` (= highest-ranked)
    words BEFORE hashing and sorting, so the choice is deterministic and does
    not depend on hash values. Each row then holds the sorted unique ids
    followed by ``-1`` padding. (Two different words hashing to the same id,
    probability ~ 2^-31 per pair, simply yield one id.)
    """
    if width < 0:
        raise ValueError("width must be >= 0")
    out = np.full((len(list_of_word_lists), width), PAD_ID, dtype=np.int32)
    for i, words in enumerate(list_of_word_lists):
        if isinstance(words, str):
            raise TypeError("pack_keywords expects a list of word lists, got a str row")
        chosen: list[str] = []
        seen: set[str] = set()
        for w in words:
            n = normalize_word(w)
            if n and n not in seen:
                seen.add(n)
                chosen.append(n)
                if len(chosen) == width:
                    break
        ids = hash_keywords(chosen)
        out[i, : len(ids)] = ids
    return out


def unpack_keywords(packed: np.ndarray) -> list[np.ndarray]:
    """Inverse of :func:`pack_keywords` on ids: the non-padding ids of each row."""
    arr = np.asarray(packed)
    if arr.ndim != 2:
        raise ValueError("packed keywords must be a 2-D array")
    return [row[row != PAD_ID].astype(np.int32) for row in arr]


def jaccard(a_words: Iterable[str], b_words: Iterable[str]) -> float:
    """Plain-Python reference Jaccard of two keyword sets (normalised words).

    ``|A & B| / |A | B|``; two empty sets give ``0.0`` (no evidence of a match).
    """
    a = {n for n in (normalize_word(w) for w in a_words) if n}
    b = {n for n in (normalize_word(w) for w in b_words) if n}
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def jaccard_ids(a_ids: np.ndarray, b_ids: np.ndarray) -> float:
    """Reference Jaccard of two (padded or unpadded) id rows; padding ignored.

    Same convention as :func:`jaccard`: both empty -> ``0.0``.
    """
    a = {int(x) for x in np.asarray(a_ids).ravel() if int(x) != PAD_ID}
    b = {int(x) for x in np.asarray(b_ids).ravel() if int(x) != PAD_ID}
    union = len(a | b)
    return len(a & b) / union if union else 0.0
