"""Each user's vocabulary and the extractive keywords chosen against it (issue 15, item 2):
pages on one topic share keywords, so the paper's F_score = cos + Jaccard >= 0.6 groups them
into segments without an LLM."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from datetime import datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu import _C
from memoryos_gpu.formats import sample_chats_path
from memoryos_gpu.lexical import page_terms
from memoryos_gpu.text.keywords import hash_keyword
from memoryos_gpu.text.vocabulary import UserVocabulary
from memoryos_gpu.types import PageInput


def terms(*texts: str):
    return page_terms(list(texts), None)


def ids(*words: str) -> np.ndarray:
    return np.array([hash_keyword(w) for w in words], np.int64)


# ------------------------------------------------------------------ the table
_OPS = st.lists(
    st.one_of(
        # additions and removals over ~1,600 keys: a key comes back often (so counts reach
        # 0 and are removed; the next test holds the removals inside long probe runs) and
        # the table grows past its first 1,024 slots
        st.tuples(
            st.just("add"),
            st.lists(
                st.tuples(st.integers(0, 3), st.integers(0, 400)).map(lambda k: k[0] << 32 | k[1]),
                max_size=700,
            ),
            st.sampled_from([1, -1, 2]),
        ),
        st.tuples(st.just("erase"), st.integers(0, 6), st.none()),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_native_key_counts_match_a_dict(ops):
    """KeyCounts (csrc/host/key_counts.cpp) against a dict: counts summed per occurrence, a
    count of 0 removed at once, a user's key range erased."""
    table, truth = _C.KeyCounts(), Counter()
    for op, arg, sign in ops:
        if op == "add":
            table.add(np.array(arg, np.int64), sign)
            for k in arg:
                truth[k] += sign
                if truth[k] == 0:
                    del truth[k]
        else:
            lo, hi = arg << 32, (arg + 1) << 32
            gone = [k for k in truth if lo <= k < hi]
            assert table.erase_range(lo, hi) == len(gone)
            for k in gone:
                del truth[k]
        assert len(table) == len(truth)
    probe = np.array([*sorted(truth), 7 << 32, 1 << 32 | 401, -5], np.int64)
    want = [truth[k] for k in probe.tolist()]
    assert table.lookup(probe).tolist() == want


def test_native_key_counts_delete_inside_probe_runs():
    """Half of 20,000 keys deleted one by one: every survivor is still found (a deletion that
    left a hole in a probe run would hide the entries after it)."""
    keys = np.random.default_rng(3).choice(1 << 40, 20_000, replace=False).astype(np.int64)
    table = _C.KeyCounts()
    table.add(keys)
    for k in keys[::2]:
        table.add(np.array([k]), -1)
    assert len(table) == 10_000
    assert table.lookup(keys[1::2]).tolist() == [1] * 10_000
    assert not table.lookup(keys[::2]).any()


def test_native_key_counts_refuse_negative_keys_whole():
    table = _C.KeyCounts()
    with pytest.raises(ValueError, match=">= 0"):
        table.add(np.array([3, -1], np.int64))
    assert len(table) == 0  # nothing of the batch went in
    with pytest.raises(ValueError, match="1-D"):
        table.lookup(np.zeros((2, 2), np.int64))


def test_df_counts_pages_per_user_once_per_distinct_term():
    v = UserVocabulary()
    v.add(["a", "a", "b"], terms("knee knee run", "knee shoes", "knee"))
    assert v.df(["a"], ids("knee", "run", "shoes", "marathon"), [4]).tolist() == [2, 1, 1, 0]
    assert v.df(["b"], ids("knee", "run"), [2]).tolist() == [1, 0]
    assert v.df(["nobody"], ids("knee"), [1]).tolist() == [0]
    assert v.pages(["a", "b", "nobody"]).tolist() == [2, 1, 0]


def test_df_looks_up_several_users_in_one_call():
    v = UserVocabulary()
    v.add(["a", "b"], terms("kelp seal", "kelp"))
    v.add(["b"], terms("kelp orkney"))
    got = v.df(["a", "b"], ids("kelp", "seal", "kelp", "orkney", "seal"), [2, 3])
    assert got.tolist() == [1, 1, 2, 1, 0]
    with pytest.raises(ValueError, match="repeats"):
        v.df(["a"], ids("kelp", "seal"), [1])


def test_keep_mask_and_uncounting():
    v = UserVocabulary()
    v.add(["a", "a"], terms("tomato basil", "tomato"), keep=np.array([True, False]))
    assert v.df(["a"], ids("tomato", "basil"), [2]).tolist() == [1, 1]
    v.add(["a"], terms("tomato basil"), sign=-1)
    assert v.df(["a"], ids("tomato", "basil"), [2]).tolist() == [0, 0]
    assert v.pages(["a"]).tolist() == [0]


def test_forget_drops_one_user_only():
    v = UserVocabulary()
    v.add(["a", "b"], terms("sourdough", "sourdough"))
    v.forget("a")
    v.forget("never-seen")
    assert v.df(["a", "b"], ids("sourdough", "sourdough"), [1, 1]).tolist() == [0, 1]


def test_merged_and_delta_counts_agree_with_a_counter():
    """Many small additions (each a delta, merged now and then) equal one count."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(400)]
    v, truth = UserVocabulary(), Counter()
    for _ in range(300):
        users = [f"u{int(u)}" for u in rng.integers(0, 30, 5)]
        texts = [" ".join(rng.choice(words, 12)) for _ in users]
        v.add(users, terms(*texts))
        for u, t in zip(users, texts, strict=True):
            truth.update((u, w) for w in set(t.split()))
    keys = list(truth)
    got = v.df([u for u, _ in keys], ids(*(w for _, w in keys)), [1] * len(keys))
    assert got.tolist() == [truth[k] for k in keys]


def test_unicode_terms_share_ids_with_keywords():
    v = UserVocabulary()
    v.add(["a", "a"], terms("Über Straße 東京", "ÜBER STRASSE"))
    assert v.df(["a"], ids("über", "strasse", "東京"), [3]).tolist() == [2, 2, 1]


# ------------------------------------------------------------------ the engine
class TopicEmbedder:
    """Each page's vector = 0.67 x its topic's axis + 0.74 x its own random direction, so two
    pages of one topic have cosine ~0.45: under theta = 0.6 alone, over it with a Jaccard of
    0.15 or more. The topic is the first word in the text that names one."""

    TOPICS = ("marathon", "sourdough", "kelp")

    def __init__(self, dim: int = 256) -> None:
        self.dim, self.model_id = dim, f"topic-{dim}"

    def _vector(self, text: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        noise = np.random.default_rng(seed).standard_normal(self.dim)
        noise[: len(self.TOPICS)] = 0.0
        v = 0.74 * noise / np.linalg.norm(noise)
        low = text.lower()
        hits = [t for t in self.TOPICS if t in low]
        if hits:
            v[self.TOPICS.index(min(hits, key=low.index))] = 0.67
        return (v / np.linalg.norm(v)).astype(np.float32)

    def encode(self, texts):
        return np.stack([self._vector(t) for t in texts]) if texts else np.zeros((0, self.dim))


TOPIC_PAGES = [
    ("Marathon training: my long run was 21 km, the knee felt stiff.", "Rest the knee."),
    ("Sourdough: my starter Pancho doubled overnight, first loaf flat.", "Proof it longer."),
    ("Kelp surveys at Scapa Flow: 18 dives, the kelp looked healthy.", "Great data."),
    ("Marathon shoes: the Brooks have 700 km, my knee aches on long runs.", "Replace them."),
    ("Sourdough loaf two had a great oven spring after a fridge proof.", "Nice crumb."),
    ("Kelp forests and warming sea temperatures are my thesis topic.", "Important work."),
    ("Marathon plan: cut to 25 km a week until the knee settles.", "Sensible."),
    ("Sourdough starter fed twice a day, the loaf rose well.", "Lovely."),
    ("Kelp samples from Orkney dives go to the lab on Monday.", "Label them."),
    ("Marathon news: new Hoka shoes and the knee feels better on long runs.", "Great."),
    ("Sourdough with rye flour: a dense loaf, the starter was sluggish.", "Try warmer water."),
    ("Kelp density at Scapa Flow doubled since the last dives.", "Good sign."),
]


def topic_segments(eng) -> dict[str, int]:
    rows = eng._state.store.query(
        "SELECT user_input, segment_id FROM pages WHERE tier = 'mtm' AND user_id = 'u'"
    )
    segs: dict[str, set[int]] = {t: set() for t in TopicEmbedder.TOPICS}
    for text, sid in rows:
        segs[text.split(":")[0].split()[0].lower()].add(sid)
    return {t: len(s) for t, s in segs.items()}


def ingest_topics(make_engine, vocabulary: bool):
    eng = make_engine(mode="extractive", embedder=TopicEmbedder())
    if not vocabulary:
        eng.stages.vocabulary = None  # the former rule: each page's own distinctive words
    filler = [(f"Note {i}: nothing much today.", "Okay.") for i in range(7)]
    for i, (q, a) in enumerate(TOPIC_PAGES + filler):
        eng.add("u", q, a, timestamp=1_700_000_000.0 + 3600 * i)
    return eng


def test_pages_of_one_topic_form_few_segments_in_extractive_mode(make_engine):
    """12 pages of 3 topics in MTM: at most 2 segments per topic (the former rule, each page's
    own distinctive words, opened 3-4 of the 4 pages' segments per topic)."""
    eng = ingest_topics(make_engine, vocabulary=True)
    per_topic = topic_segments(eng)
    assert sum(per_topic.values()) <= 6, per_topic
    assert all(n <= 2 for n in per_topic.values()), per_topic
    old = topic_segments(ingest_topics(make_engine, vocabulary=False))
    assert sum(old.values()) >= 2 * sum(per_topic.values()), old


def test_vocabulary_survives_reopen_edit_and_delete(make_engine, tmp_path):
    store = str(tmp_path / "s.sqlite3")
    eng = make_engine(mode="extractive", embedder=TopicEmbedder(), store=store)
    pid = eng.add("u", "my knee hurts", "rest it", timestamp=1.0).page_id
    eng.add("u", "knee and shoes", "ok", timestamp=2.0)
    knee = ids("knee", "shoes", "hurts")
    before = eng._state.vocabulary.df(["u"], knee, [3]).tolist()
    assert before == [2, 1, 1]
    eng.close()
    again = make_engine(mode="extractive", embedder=TopicEmbedder(), store=store)
    assert again._state.vocabulary.df(["u"], knee, [3]).tolist() == before
    again.update_page(pid, user_input="my ankle hurts")
    assert again._state.vocabulary.df(["u"], knee, [3]).tolist() == [1, 1, 1]
    again.delete_page(pid)
    assert again._state.vocabulary.df(["u"], knee, [3]).tolist() == [1, 1, 0]
    assert again._state.vocabulary.pages(["u"]).tolist() == [1]
    again.delete_user("u")
    assert again._state.vocabulary.pages(["u"]).tolist() == [0]


@pytest.mark.slow
def test_sample_running_pages_form_at_most_three_segments():
    """The bundled quick-start sample with the bundled MiniLM, as ``memoryos-gpu ingest`` runs
    it: Maya's six running pages in MTM (training, long run, shoes, physio, distance, new
    shoes) had pairwise keyword Jaccard 0 and opened six segments."""
    from memoryos_gpu.config import EngineConfig
    from memoryos_gpu.engine import MemoryEngine

    eng = MemoryEngine(EngineConfig(device="cpu"))
    recs = [json.loads(line) for line in sample_chats_path().read_text().splitlines()]
    eng.add_many(
        PageInput(
            r["user_id"],
            r["user_input"],
            r["agent_response"],
            datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")).timestamp(),
            assistant_id=r["assistant_id"],
        )
        for r in recs
    )
    rows = eng._state.store.query(
        "SELECT segment_id FROM pages WHERE user_id = 'maya_chen' AND tier = 'mtm' ORDER BY seq"
    )
    assert len(rows) == 18
    running = {rows[i][0] for i in (2, 3, 4, 12, 13, 14)}
    assert len(running) <= 3
    eng.close()
