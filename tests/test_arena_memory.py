"""The arena's host memory: reservations that grow in place, bounded GPU growth steps, the block
table's allocated columns, and the lexical index's rows through writes, clears and compaction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memoryos_gpu import arena_lexical
from memoryos_gpu.arena import (
    Arena,
    ArenaConfig,
    grow_in_place,
    grown_capacity,
    lazy_zeros,
    move_live_rows,
)


def test_lazy_arrays_grow_in_place_and_keep_their_rows() -> None:
    a = lazy_zeros((1000, 384), np.float32)  # 1.5 MB... below the lazy threshold: plain zeros
    assert grow_in_place(a, 2000) is None
    b = lazy_zeros((10_000, 384), np.float32)  # 15 MB: a reservation 64 times larger
    b[17] = 3.0
    c = grow_in_place(b, 200_000)
    assert c is not None and c.shape == (200_000, 384)
    assert c.ctypes.data == b.ctypes.data  # the same memory: nothing was copied
    assert (c[17] == 3.0).all() and not c[18:].any()
    b[5] = 1.0  # the old view is still valid and sees the same rows
    assert (c[5] == 1.0).all()
    assert grow_in_place(b, 10**9) is None  # beyond the reservation: the caller copies
    assert grow_in_place(b[1:], 20_000) is None  # not a view from the reservation's start


@pytest.mark.parametrize("block_bytes", [4096, 1 << 20, 64 << 20])
def test_moving_live_rows_copies_them_and_releases_the_old_ones(monkeypatch, block_bytes) -> None:
    """A widening's copy: the live rows arrive, the dead ones stay zero, and the old lazy
    array's whole pages are given back as each block is copied (they read zero)."""
    import memoryos_gpu.arena_memory as arena_mod

    monkeypatch.setattr(arena_mod, "_MOVE_BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(block_bytes)
    old = lazy_zeros((3000, 8, 96), np.float32)  # 9 MB: lazily backed
    live = rng.random((3000, 8)) < 0.4
    old[live] = rng.normal(size=(int(live.sum()), 96))
    want = old.copy()
    out = lazy_zeros((3000, 16, 96), np.float32)
    move_live_rows(out, old, live)
    np.testing.assert_array_equal(out[:, :8][live], want[live])
    assert not out[:, :8][~live].any() and not out[:, 8:].any()
    page_floats = 4096 // 4
    assert not old.reshape(-1)[page_floats:-page_floats].any()  # every inner page released
    small = np.ones((10, 2, 3), np.float32)  # not lazy: copied, left as it was
    out_small = np.zeros((10, 4, 3), np.float32)
    move_live_rows(out_small, small, np.ones((10, 2), bool))
    assert out_small[:, :2].all() and small.all()


def test_widening_the_rings_holds_little_more_than_the_new_rows(tmp_path) -> None:
    """Peak memory of a ring widening in a fresh process: the new rows and one block, not the
    old, a gathered copy and the new rows at once (10,000 owners x 8 live entries: 123 MB)."""
    import subprocess
    import sys

    script = """
import resource, sys
import numpy as np
from memoryos_gpu.arena import Arena, ArenaConfig
a = Arena(ArenaConfig(dim=384, initial_owners=10_000, knowledge_capacity=100))
owners = np.repeat(a.add_owners(10_000), 8).astype(np.int32)
ring = np.tile(np.arange(8), 10_000).astype(np.int32)
for i in range(0, owners.size, 8_000):
    e = np.random.default_rng(i).normal(size=(min(8_000, owners.size - i), 384)).astype(np.float32)
    a.write_knowledge(owners[i : i + 8_000], ring[i : i + 8_000], e)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
a.write_knowledge(np.array([0], np.int32), np.array([8], np.int32), np.ones((1, 384), np.float32))
assert a.knowledge_width == 16
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    grew_mb = int(out.stdout.split()[-1]) / 1024
    live_mb = 10_000 * 8 * 384 * 4 / 2**20
    assert grew_mb < 0.6 * live_mb, (grew_mb, live_mb)


def test_gpu_growth_doubles_then_steps() -> None:
    assert grown_capacity(16, 17) == 32
    assert grown_capacity(1 << 16, (1 << 16) + 1) == 1 << 17
    assert grown_capacity(1 << 17, (1 << 17) + 1) == (1 << 17) + (1 << 16)  # a bounded step
    assert grown_capacity(1 << 17, 1 << 20) == 1 << 20  # never less than asked


def test_host_arena_grows_users_and_pages_without_losing_rows() -> None:
    arena = Arena(ArenaConfig(dim=384, initial_users=16, initial_blocks=16))
    rng = np.random.default_rng(0)
    embs = {}
    for round_ in range(6):  # users and pages outgrow the initial capacity several times
        users = arena.add_users(3000)
        seg = rng.normal(size=(users.size, 384)).astype(np.float32)
        arena.write_segments(
            users, np.zeros(users.size, np.int32), seg, np.full((users.size, 32), -1)
        )
        pool = arena.append_pages(users, np.zeros(users.size, np.int32), seg)
        embs.update(zip(pool.tolist(), seg, strict=True))
        if round_ == 0:
            first_users, first_seg = users, seg
    page_emb = arena.host("page_emb")
    for slot, e in list(embs.items())[::997]:
        np.testing.assert_array_equal(page_emb[slot], e)
    np.testing.assert_array_equal(arena.host("seg_emb")[first_users, 0], first_seg)


def _model_check(rows: arena_lexical.LexicalRows, model: dict[int, tuple]) -> None:
    slots = np.arange(rows.count.shape[0])
    got = rows.rows_of(slots)
    for s, (ids, tf, length) in zip(slots.tolist(), got, strict=True):
        want = model.get(s)
        if want is None:
            assert ids.size == 0
        else:
            assert ids.tolist() == want[0] and tf.tolist() == want[1] and length == want[2]
    assert rows.live == sum(len(v[0]) for v in model.values())


ops = st.lists(
    st.tuples(
        st.sampled_from(["write", "clear", "compact"]),
        st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True),
        st.integers(0, 2**31 - 1),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(steps=ops)
def test_lexical_rows_equal_a_dict_model(steps) -> None:
    """Random writes (new and rewritten rows), clears and compactions of term rows equal a dict
    of the last row written per slot; compaction keeps exactly the live rows."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(arena_lexical, "_MIN_COMPACT", 4)  # compactions happen in small runs
        _run_lexical_steps(steps)


def _run_lexical_steps(steps) -> None:
    arena = Arena(ArenaConfig(dim=2, initial_blocks=12))
    rows = arena.lexical
    model: dict[int, tuple] = {}
    for kind, slots, seed in steps:
        rng = np.random.default_rng(seed)
        if kind == "write":
            counts = rng.integers(0, 6, len(slots))
            offsets = np.concatenate([[0], np.cumsum(counts)])
            ids = [sorted(rng.choice(1000, c, replace=False).tolist()) for c in counts]
            tfs = [rng.integers(1, 4, c).tolist() for c in counts]
            lengths = rng.integers(0, 20, len(slots))
            rows.write(
                np.array(slots),
                offsets,
                np.array([i for r in ids for i in r], np.int32),
                np.array([t for r in tfs for t in r], np.int32),
                lengths,
            )
            for s, i, t, n in zip(slots, ids, tfs, lengths.tolist(), strict=True):
                model[s] = (i, t, n) if i else None
            model = {k: v for k, v in model.items() if v is not None}
        elif kind == "clear":
            rows.clear(np.array(slots))
            for s in slots:
                model.pop(s, None)
        else:
            rows.compact()
            assert rows.used == rows.live
        _model_check(rows, model)
