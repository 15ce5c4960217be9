"""Encryption at rest (memoryos_gpu.store.encryption): an encrypted store holds no plaintext in
its file or write-ahead log, a wrong or missing key is a clear error that leaves the file as it
was, the key never shows, and ``rekey`` changes the key (or encrypts a plain store, one way)
without losing a row, even when it fails half way. The crash tests (tests/test_crash.py) run
on an encrypted store too."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

pytest.importorskip("sqlcipher3")

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store import StoreError, StoreLockedError, open_store
from memoryos_gpu.store import encryption as enc

KEY = "correct horse 'battery' staple"
MARKER = "ZQXMARKERWORD"  # a word no SQLite page holds by chance
PAGES = 12


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(enc.ENV_KEY, raising=False)
    monkeypatch.delenv(enc.ENV_NEW_KEY, raising=False)


def config(store: Path, key: str | None = None) -> EngineConfig:
    return EngineConfig(store=str(store), embedder="hashing", device="cpu", encryption_key=key)


def fill(store: Path, key: str | None) -> None:
    """A closed store of one user whose pages all carry MARKER."""
    e = MemoryEngine(config(store, key))
    try:
        for i in range(PAGES):
            e.add("alice", f"my {MARKER} number {i}", f"noted {MARKER} {i}", timestamp=float(i))
    finally:
        e.close()


def raw_bytes(store: Path) -> bytes:
    """The database file and, when there is one, its write-ahead log."""
    out = store.read_bytes()
    wal = Path(f"{store}-wal")
    return out + (wal.read_bytes() if wal.exists() else b"")


def test_encrypted_store_has_no_plaintext_in_file_or_wal(tmp_path: Path) -> None:
    plain, secret = tmp_path / "plain.sqlite3", tmp_path / "secret.sqlite3"
    fill(plain, None)
    assert MARKER.encode() in raw_bytes(plain)  # the grep finds the word where it is plain
    e = MemoryEngine(config(secret, KEY))
    try:
        for i in range(PAGES):
            e.add("alice", f"my {MARKER} number {i}", f"noted {MARKER} {i}", timestamp=float(i))
        assert e.store.encrypted
        wal = Path(f"{secret}-wal")
        assert wal.stat().st_size > 0  # the pages are in the log right now, still unreadable
        assert e.store.query("PRAGMA journal_mode") == [("wal",)]
        blob = raw_bytes(secret)
        assert MARKER.encode() not in blob and b"alice" not in blob
        assert not blob.startswith(b"SQLite format 3")
    finally:
        e.close()
    blob = raw_bytes(secret)
    assert MARKER.encode() not in blob and b"alice" not in blob


def test_reopen_with_the_key_gives_everything_back(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    fill(store, KEY)
    e = MemoryEngine(config(store, KEY))
    try:
        assert e.store.encrypted
        assert e.store.query("SELECT COUNT(*) FROM pages") == [(PAGES,)]
        r = e.retrieve_many([("alice", f"{MARKER} number 3")], update_heat=False)[0]
        assert r.stm and all(MARKER in p.user_input for p in r.stm)
        assert e.store.check_integrity() == []
        # delete_user's secure_delete and log truncation run on the encrypted connection too
        assert e.store.delete_user("alice") and e.store.rows_about("alice") == 0
        assert e.store.query("PRAGMA secure_delete") == [(1,)]
    finally:
        e.close()


@pytest.mark.parametrize("key", [None, "wrong key"], ids=["missing", "wrong"])
def test_wrong_or_missing_key_is_a_clear_error_and_touches_nothing(
    tmp_path: Path, key: str | None
) -> None:
    store = tmp_path / "s.sqlite3"
    fill(store, KEY)
    before = store.read_bytes()
    match = "wrong encryption key" if key else r"encrypted .give its key"
    with pytest.raises(StoreError, match=match):
        MemoryEngine(config(store, key))
    with pytest.raises(StoreError, match=match):
        open_store(str(store), key=key, writer=False)
    assert store.read_bytes() == before
    st = open_store(str(store), key=KEY)  # the failed opens released the writer claim
    assert st.counts()["pages_stm"] + st.counts().get("pages_mtm", 0) >= 1
    st.close()


def test_key_for_a_plain_store_is_refused_not_an_empty_store(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    fill(store, None)
    before = store.read_bytes()
    with pytest.raises(StoreError, match=r"not encrypted.*rekey --encrypt"):
        MemoryEngine(config(store, KEY))
    assert store.read_bytes() == before


def test_environment_key_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "s.sqlite3"
    monkeypatch.setenv(enc.ENV_KEY, KEY)
    cfg = EngineConfig(store=str(store), embedder="hashing", device="cpu")
    assert cfg.encryption_key is not None and cfg.encryption_key.get_secret_value() == KEY
    fill(store, None)  # encryption_key=None explicitly still falls back to the variable
    st = open_store(str(store), writer=False)
    assert st.encrypted and st.query("SELECT COUNT(*) FROM pages") == [(PAGES,)]
    st.close()
    monkeypatch.delenv(enc.ENV_KEY)
    with pytest.raises(StoreError, match="encrypted"):
        open_store(str(store), writer=False)


def test_the_key_never_shows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "s.sqlite3"
    caplog.set_level(logging.DEBUG)
    cfg = config(store, KEY)
    shown = [repr(cfg), str(cfg), cfg.model_dump_json(), str(cfg.model_dump())]
    fill(store, KEY)
    for bad in ("wrong", None):
        with pytest.raises(StoreError) as err:
            open_store(str(store), key=bad)
        shown.append(str(err.value))
    e = MemoryEngine(cfg)
    shown.append(repr(e.stats()))
    e.close()
    shown.append(caplog.text)
    assert all(KEY not in s and "battery" not in s for s in shown)
    assert "**********" in shown[0]
    # a config dumped and validated again (the server, Ray) still carries the real key
    again = EngineConfig.model_validate(cfg.model_dump())
    assert again.encryption_key.get_secret_value() == KEY


def test_bad_keys_are_refused(tmp_path: Path) -> None:
    for bad in ("", "a\x00b"):
        with pytest.raises(StoreError, match=r"empty|NUL"):
            open_store(str(tmp_path / "s.sqlite3"), key=bad)
    with pytest.raises(StoreError, match="SQLite stores only"):
        open_store("postgresql://nobody@127.0.0.1:1/none", key=KEY)


def test_raw_hex_key_skips_the_passphrase_derivation(tmp_path: Path) -> None:
    """SQLCipher takes ``x'<64 hex digits>'`` as the 256-bit key itself (no PBKDF2)."""
    store, key = tmp_path / "s.sqlite3", "x'" + "2d" * 32 + "'"
    fill(store, key)
    with pytest.raises(StoreError, match="wrong encryption key"):
        open_store(str(store), key="x'" + "2e" * 32 + "'")
    st = open_store(str(store), key=key)
    assert st.query("SELECT COUNT(*) FROM pages") == [(PAGES,)]
    st.close()


def _pages(store: Path, key: str) -> list[tuple]:
    st = open_store(str(store), key=key, writer=False)
    try:
        return st.query(
            "SELECT p.page_id, p.user_input, v.embedding FROM pages p JOIN page_vectors v "
            "ON v.page_id = p.page_id ORDER BY p.page_id"
        )
    finally:
        st.close()


def test_rekey_changes_the_key_and_keeps_every_row(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    fill(store, KEY)
    before = _pages(store, KEY)
    enc.rekey(store, SecretStr(KEY), SecretStr("the new key"))
    with pytest.raises(StoreError, match="wrong encryption key"):
        open_store(str(store), key=KEY)
    assert _pages(store, "the new key") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sqlite3", "s.sqlite3.lock"]
    e = MemoryEngine(config(store, "the new key"))  # a usable store again, in WAL mode
    try:
        assert e.store.query("PRAGMA journal_mode") == [("wal",)]
        e.add("alice", "after the rekey", "ok", timestamp=100.0)
    finally:
        e.close()
    with pytest.raises(StoreError, match="wrong encryption key"):
        enc.rekey(store, SecretStr(KEY), SecretStr("x"))


def test_encrypt_converts_a_plain_store_one_way(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    fill(store, None)
    st = open_store(str(store), key=None, writer=False)
    before = st.query(
        "SELECT p.page_id, p.user_input, v.embedding FROM pages p JOIN page_vectors v "
        "ON v.page_id = p.page_id ORDER BY p.page_id"
    )
    st.close()
    enc.rekey(store, None, SecretStr(KEY))
    assert MARKER.encode() not in raw_bytes(store)
    assert _pages(store, KEY) == before
    with pytest.raises(StoreError, match="already encrypted"):
        enc.rekey(store, None, SecretStr(KEY))
    plain = tmp_path / "p.sqlite3"
    fill(plain, None)
    with pytest.raises(StoreError, match="not encrypted"):
        enc.rekey(plain, SecretStr(KEY), SecretStr("new"))


def test_rekey_is_refused_while_a_writer_holds_the_store(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    fill(store, KEY)
    e = MemoryEngine(config(store, KEY))
    try:
        with pytest.raises(StoreLockedError):
            enc.rekey(store, SecretStr(KEY), SecretStr("new"))
    finally:
        e.close()
    assert len(_pages(store, KEY)) == PAGES


def _rekey_failing_at_the_rename(
    store: Path, monkeypatch: pytest.MonkeyPatch, *, crash: bool = True
) -> list[tuple]:
    """A store filled under KEY whose rekey to "new" fails at its final rename; returns the
    store's pages before. ``crash``: as a SIGKILL there, which runs no cleanup (the complete
    copy stays beside the store); else a failure the rekey sees, whose copy it removes."""
    fill(store, KEY)
    before = _pages(store, KEY)

    def fail(*_: object) -> None:
        raise OSError("disk went away")

    with monkeypatch.context() as m:
        m.setattr(enc.os, "replace", fail)
        if crash:
            m.setattr(enc, "remove_rekey_leftovers", lambda path: None)
        with pytest.raises(OSError, match="disk went away"):
            enc.rekey(store, SecretStr(KEY), SecretStr("new"))
    return before


def test_a_rekey_that_fails_before_the_rename_removes_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure (or Ctrl-C) between the copy and the rename: the store-sized copy goes at
    once, under the claim, not at the next writer's open; the store is the old one."""
    store = tmp_path / "s.sqlite3"
    before = _rekey_failing_at_the_rename(store, monkeypatch, crash=False)
    assert not [p.name for p in tmp_path.iterdir() if enc.REKEY_SUFFIX in p.name]
    assert _pages(store, KEY) == before


def test_rekey_failing_before_the_rename_leaves_the_store_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "s.sqlite3"
    before = _rekey_failing_at_the_rename(store, monkeypatch)
    assert Path(f"{store}.rekey-tmp").exists()  # what a crash there would leave
    assert _pages(store, KEY) == before  # the old key still opens everything
    enc.rekey(store, SecretStr(KEY), SecretStr("new"))  # and a rerun replaces the leftover
    assert _pages(store, "new") == before
    assert not Path(f"{store}.rekey-tmp").exists()


def test_the_copy_of_a_rekey_that_died_is_removed_by_the_next_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rekey that dies before its rename (here: the rename fails, leaving what SIGKILL
    there leaves: the complete copy, plus the journal a kill during the copy leaves) used to
    leave them until a rerun of rekey. An engine opening the store for writing removes them;
    the store is the one it was, under its old key."""
    store = tmp_path / "s.sqlite3"
    before = _rekey_failing_at_the_rename(store, monkeypatch)
    copy, journal = Path(f"{store}.rekey-tmp"), Path(f"{store}.rekey-tmp-journal")
    journal.write_bytes(b"\0" * 512)
    assert copy.stat().st_size > 0
    MemoryEngine(config(store, KEY)).close()
    assert not copy.exists() and not journal.exists()
    assert _pages(store, KEY) == before


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMORYOS_GPU_")}
    full.update({"MEMORYOS_GPU_EMBEDDER": "hashing", **env})
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )


def test_cli_encrypt_rekey_and_read(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    fill(store / "memory.sqlite3", None)
    r = _cli("rekey", "--encrypt", "--store", str(store), env={enc.ENV_KEY: KEY})
    assert r.returncode == 0, r.stderr
    assert "encrypted 1 of 1 store file" in r.stdout
    r = _cli("stats", "--json", "--store", str(store), env={})
    assert r.returncode == 1 and "give its key" in r.stderr
    r = _cli("stats", "--json", "--store", str(store), env={enc.ENV_KEY: KEY})
    assert r.returncode == 0, r.stderr
    assert KEY not in r.stdout + r.stderr
    new = {enc.ENV_KEY: KEY, enc.ENV_NEW_KEY: "second key"}
    r = _cli("rekey", "--store", str(store), env=new)
    assert r.returncode == 0, r.stderr
    r = _cli("profile", "--user", "alice", "--store", str(store), env={enc.ENV_KEY: KEY})
    assert r.returncode == 1 and "wrong encryption key" in r.stderr
    r = _cli("export", "--user", "alice", "--store", str(store), env={enc.ENV_KEY: "second key"})
    assert r.returncode == 0 and MARKER in r.stdout


def test_missing_sqlcipher_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sqlcipher3", None)  # as if the extra were not installed
    store = tmp_path / "s.sqlite3"
    with pytest.raises(StoreError, match=r"memoryos-gpu\[encryption\]"):
        open_store(str(store), key=KEY)
    assert not store.exists() or store.stat().st_size == 0
    open_store(str(store)).close()  # the plain store needs nothing more


def test_rekey_all_checks_every_shard_first_and_finishes_a_half_done_run(tmp_path: Path) -> None:
    shards = [tmp_path / f"shard-{i}.sqlite3" for i in range(3)]
    for s in shards:
        fill(s, KEY)
    before = _pages(shards[2], KEY)
    enc.rekey(shards[0], SecretStr(KEY), SecretStr("new"))  # a run interrupted after shard 0
    fill(tmp_path / "odd.sqlite3", "another key")
    with pytest.raises(StoreError, match="wrong encryption key"):  # checked before any write
        enc.rekey_all([*shards, tmp_path / "odd.sqlite3"], SecretStr(KEY), SecretStr("new"))
    assert _pages(shards[2], KEY) == before  # untouched
    assert enc.rekey_all(shards, SecretStr(KEY), SecretStr("new")) == 2  # shard 0 skipped
    assert all(_pages(s, "new") for s in shards)
    assert _pages(shards[2], "new") == before
