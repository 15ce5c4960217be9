"""How the encrypted SQLite store fails (memoryos_gpu.store.encryption, the open of
memoryos_gpu.store.sqlite, the writer claim of memoryos_gpu.store.writer): a key that cannot be
one is refused before anything touches the disk, the right key on a read-only or full disk is
said as such (never "wrong encryption key"), a rekey without room leaves the store as it was,
a full disk at the writer claim is a StoreFullError, and an open that fails for any reason
gives the claim back.

The machine's failures are reproduced without root: SQLite's own errors come from a ``-shm``
index it cannot open (a dangling symlink: "unable to open database file", what a read-only
file system gives; a FIFO: "disk I/O error", what a full tmpfs gives), and only the probes of
the file system (read-only? room left?) are stood in for. One test repeats it all on real
tmpfs mounts, and skips unless run as root where ``mount`` works."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from test_encryption import _cli  # one way to run the CLI with a key

pytest.importorskip("sqlcipher3")

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store import StoreError, StoreFullError, StoreLockedError, open_store
from memoryos_gpu.store import encryption as enc
from memoryos_gpu.store import errors as store_errors
from memoryos_gpu.store import writer as writer_mod
from memoryos_gpu.store.sqlite import SQLiteStore
from memoryos_gpu.store.writer import SQLiteWriterLock, lock_path

KEY = "correct horse 'battery' staple"
BAD_UTF8 = "passw\udcf6rd"  # what Python makes of MEMORYOS_GPU_KEY=$'passw\xf6rd'
WRONG_KEY = "wrong encryption key"


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(enc.ENV_KEY, raising=False)
    monkeypatch.delenv(enc.ENV_NEW_KEY, raising=False)


def make_store(path: Path, key: str | None, pages: int = 6) -> None:
    """A closed store (plain when ``key`` is None) holding a few pages of one user."""
    cfg = EngineConfig(store=str(path), embedder="hashing", device="cpu", encryption_key=key)
    e = MemoryEngine(cfg)
    try:
        for i in range(pages):
            e.add("alice", f"page {i} " + "words " * 50, f"reply {i}", timestamp=float(i))
    finally:
        e.close()


def lock_is_free(path: Path) -> bool:
    """Whether nobody (this process included: flock is per open file) claims the store."""
    lock = SQLiteWriterLock(path)
    try:
        lock.acquire()
    except StoreLockedError:
        return False
    lock.release()
    return True


def open_fds_to(path: Path) -> int:
    """How many of this process's descriptors are open on ``path``."""
    target = os.path.realpath(path)
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == target)


# ================================================================ 1. an empty $MEMORYOS_GPU_KEY
def test_an_empty_key_variable_is_refused_not_a_plain_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MEMORYOS_GPU_KEY="$UNSET"`` must not write a plain store: refused as the API refuses
    an empty key, the message naming the variable."""
    monkeypatch.setenv(enc.ENV_KEY, "")
    store = tmp_path / "st"
    with pytest.raises(StoreError, match=r"\$MEMORYOS_GPU_KEY: the encryption key is empty"):
        enc.env_key()
    with pytest.raises(StoreError, match=r"\$MEMORYOS_GPU_KEY: the encryption key is empty"):
        open_store(str(store))
    with pytest.raises(StoreError, match=r"\$MEMORYOS_GPU_KEY: the encryption key is empty"):
        EngineConfig(store=str(store), embedder="hashing", device="cpu")
    assert not store.exists()


def test_the_key_variable_follows_the_apis_rule_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API refuses a whitespace-only key (what a variable holding a stray blank gives), and
    so does the variable: one rule, before anything is created; a key with blanks around other
    text is taken as it is, either way, and opens the same store."""
    with pytest.raises(StoreError, match="blank"):
        enc.as_secret("  ")  # the API's rule
    monkeypatch.setenv(enc.ENV_KEY, "  ")
    store = tmp_path / "s.sqlite3"
    with pytest.raises(StoreError, match="blank"):
        open_store(str(store))
    assert not store.exists()
    monkeypatch.setenv(enc.ENV_KEY, " k ")
    open_store(str(store)).close()
    assert enc.file_state(store) == "encrypted"
    monkeypatch.delenv(enc.ENV_KEY)
    open_store(str(store), key=" k ", writer=False).close()


def test_cli_ingest_with_an_empty_key_variable_writes_nothing(tmp_path: Path) -> None:
    """The tester's repro (repro_emptyenv): exit 2 (bad configuration) with the message, no
    store."""
    from memoryos_gpu.formats import sample_chats_path

    store = tmp_path / "st"
    args = ("ingest", str(sample_chats_path()), "--store", str(store), "--no-progress")
    r = _cli(*args, "--no-summary", env={enc.ENV_KEY: ""})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "$MEMORYOS_GPU_KEY: the encryption key is empty" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (store / "memory.sqlite3").exists()


# ================================================================ 4. a key that is not UTF-8
def test_a_key_that_is_not_utf8_is_refused_before_anything_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "st"
    with pytest.raises(StoreError, match="the encryption key is not valid UTF-8 text") as err:
        SQLiteStore(store / "memory.sqlite3", key=BAD_UTF8)
    assert "passw" not in str(err.value) and err.value.__cause__ is None
    assert not store.exists()  # no empty database, no lock file with a holder record
    monkeypatch.setenv(enc.ENV_KEY, BAD_UTF8)
    with pytest.raises(StoreError, match=r"\$MEMORYOS_GPU_KEY: .*not valid UTF-8") as err:
        open_store(str(store))
    assert "passw" not in str(err.value)
    assert not store.exists()


def test_rekey_refuses_a_new_key_that_is_not_utf8_untouched(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    make_store(store, KEY)
    before = store.read_bytes()
    with pytest.raises(StoreError, match="not valid UTF-8"):
        enc.rekey(store, SecretStr(KEY), SecretStr(BAD_UTF8))
    with pytest.raises(StoreError, match="not valid UTF-8"):
        enc.rekey_all([store], SecretStr(BAD_UTF8), SecretStr("new"))
    assert store.read_bytes() == before
    assert not Path(f"{store}.rekey-tmp").exists()


# ========================================= 4b. any failure while opening gives the claim back
@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "encrypted"])
def test_any_exception_while_opening_releases_the_claim_and_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str | None
) -> None:
    store = tmp_path / "s.sqlite3"
    make_store(store, key)

    def fail(*_: Any, **__: Any) -> None:
        raise RuntimeError("not a driver error")

    with monkeypatch.context() as m:  # in connect ...
        m.setattr(enc, "connect", fail)
        with pytest.raises(RuntimeError, match="not a driver error"):
            SQLiteStore(store, key=key)
    assert lock_is_free(store)
    with monkeypatch.context() as m:  # ... and after it (configuring, migrating)
        m.setattr(SQLiteStore, "_migrate", fail)
        with pytest.raises(RuntimeError, match="not a driver error"):
            SQLiteStore(store, key=key)
    assert lock_is_free(store)
    assert open_fds_to(store) == 0  # the connection was closed
    SQLiteStore(store, key=key).close()


# ============================= 2. the right key on a disk that cannot be written is not "wrong"
def _unopenable_index(store: Path, how: str) -> None:
    """Make SQLite fail on the store's ``-shm`` index, as a read-only (``cantopen``) or full
    (``ioerr``) file system makes it fail, with the database file itself intact."""
    shm = Path(f"{store}-shm")
    shm.unlink(missing_ok=True)
    if how == "cantopen":
        shm.symlink_to(store.parent / "no such dir" / "x")  # "unable to open database file"
    else:
        os.mkfifo(shm)  # "disk I/O error"


@pytest.mark.parametrize("writer", [False, True], ids=["reader", "writer"])
@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "encrypted"])
def test_the_right_key_with_an_unopenable_index_is_not_a_wrong_key(
    tmp_path: Path, key: str | None, writer: bool
) -> None:
    store = tmp_path / "s.sqlite3"
    make_store(store, key)
    before = store.read_bytes()
    for how, words in (("cantopen", "unable to open database file"), ("ioerr", "I/O error")):
        _unopenable_index(store, how)
        with pytest.raises(StoreError) as err:
            open_store(str(store), key=key, writer=writer)
        assert WRONG_KEY not in str(err.value)
        assert words in str(err.value) and "cannot open store" in str(err.value)
        assert lock_is_free(store)
    assert store.read_bytes() == before
    if key is not None:
        with pytest.raises(StoreError, match=WRONG_KEY):  # a wrong key is still told as one
            open_store(str(store), key="another key", writer=writer)


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "encrypted"])
def test_a_read_only_file_system_is_said_alike_for_plain_and_encrypted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str | None
) -> None:
    store = tmp_path / "s.sqlite3"
    make_store(store, key)
    _unopenable_index(store, "cantopen")  # SQLite's error on a read-only mount
    monkeypatch.setattr(store_errors, "_on_read_only_fs", lambda _: True)
    with pytest.raises(StoreError, match="its file system is read-only") as err:
        open_store(str(store), key=key, writer=False)
    assert WRONG_KEY not in str(err.value) and not isinstance(err.value, StoreFullError)


@pytest.mark.parametrize("how", ["cantopen", "ioerr"])
@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "encrypted"])
def test_a_full_disk_at_open_is_a_store_full_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str | None, how: str
) -> None:
    store = tmp_path / "s.sqlite3"
    make_store(store, key)
    _unopenable_index(store, how)  # what a full tmpfs does to the -shm index
    monkeypatch.setattr(store_errors, "_low_on_space", lambda _: True, raising=False)
    with pytest.raises(StoreFullError, match="the disk is full") as err:
        open_store(str(store), key=key, writer=False)
    assert WRONG_KEY not in str(err.value)


# ============================================================ 3. rekey on a disk without room
def _small_disk(monkeypatch: pytest.MonkeyPatch, pages: int = 3) -> None:
    """Let the copy that rekey writes hold only ``pages`` pages: SQLCipher's own
    ``sqlcipher_export`` then fails half way with "database or disk is full", as on a disk
    without room for the copy (``max_page_count`` of the attached copy)."""
    real = enc.driver()

    class SmallDisk(real.Connection):  # type: ignore[name-defined, misc]
        def execute(self, sql: str, *args: Any) -> Any:
            cursor = super().execute(sql, *args)
            if sql.startswith("ATTACH DATABASE"):
                super().execute(f"PRAGMA rekeyed.max_page_count = {pages}")
            return cursor

    def connect(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("factory", SmallDisk)
        return real.connect(*args, **kwargs)

    fake = types.ModuleType(real.__name__)  # a module: the connection factories key on it
    fake.__dict__.update({n: getattr(real, n) for n in dir(real) if n[0] != "_"})
    fake.connect = connect  # type: ignore[attr-defined]
    monkeypatch.setattr(enc, "driver", lambda: fake)


@pytest.mark.parametrize("old", [KEY, None], ids=["rekey", "encrypt"])
def test_rekey_without_room_is_a_store_full_error_and_leaves_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str | None
) -> None:
    store = tmp_path / "s.sqlite3"
    make_store(store, old)
    before = store.read_bytes()
    old_key = SecretStr(old) if old else None
    with monkeypatch.context() as m:
        _small_disk(m)
        with pytest.raises(StoreFullError, match="the disk is full") as err:
            enc.rekey(store, old_key, SecretStr("new key"))
    assert "store is unchanged" in str(err.value)
    assert KEY not in str(err.value) and "new key" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sqlite3", "s.sqlite3.lock"]
    assert store.read_bytes() == before
    assert lock_is_free(store)
    st = open_store(str(store), key=old, writer=False)  # still the old key, every row
    assert st.query("SELECT COUNT(*) FROM pages") == [(6,)]
    st.close()
    enc.rekey(store, old_key, SecretStr("new key"))  # once there is room, it goes through
    open_store(str(store), key="new key", writer=False).close()


# ============================================================== 5. a full disk at the claim
def test_a_full_disk_when_claiming_is_a_store_full_error_with_nothing_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "st" / "memory.sqlite3"

    def no_space(*_: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    store.parent.mkdir()
    with monkeypatch.context() as m:
        m.setattr(writer_mod.os, "pwrite", no_space)
        lock = SQLiteWriterLock(store.parent / "x.sqlite3")
        with pytest.raises(StoreFullError, match="the disk is full"):
            lock.acquire()
        assert not lock.held
        assert open_fds_to(lock_path(store.parent / "x.sqlite3")) == 0
        with pytest.raises(StoreFullError, match=r"cannot claim store .*the disk is full"):
            open_store(str(store.parent))
    assert not store.exists()  # the database is never touched without the claim
    assert lock_is_free(store) and lock_is_free(store.parent / "x.sqlite3")
    open_store(str(store.parent)).close()


def test_other_errors_writing_the_claim_are_store_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def io_error(*_: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(writer_mod.os, "ftruncate", io_error)
    lock = SQLiteWriterLock(tmp_path / "s.sqlite3")
    with pytest.raises(StoreError, match="cannot write the writer lock") as err:
        lock.acquire()
    assert not isinstance(err.value, StoreFullError) and not lock.held
    assert open_fds_to(lock.path) == 0


# ======================================================== 6. --encrypt of an encrypted store
def test_encrypting_a_store_already_under_that_key_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "s.sqlite3"
    make_store(store, KEY)
    before = store.read_bytes()
    with pytest.raises(StoreError, match=r"already encrypted \(under this key\)"):
        enc.rekey_all([store], None, SecretStr(KEY))
    with pytest.raises(StoreError, match="already encrypted"):  # under another key
        enc.rekey_all([store], None, SecretStr("another key"))
    assert store.read_bytes() == before


def test_encrypting_finishes_a_half_done_sharded_run(tmp_path: Path) -> None:
    """The skip of files already under the key stays: only an --encrypt with nothing left to
    do at all is refused."""
    shards = [tmp_path / f"shard-{i}.sqlite3" for i in range(2)]
    make_store(shards[0], KEY)  # encrypted by an interrupted run
    make_store(shards[1], None)
    assert enc.rekey_all(shards, None, SecretStr(KEY)) == 1
    with pytest.raises(StoreError, match=r"all 2 store files are already encrypted"):
        enc.rekey_all(shards, None, SecretStr(KEY))


def test_cli_encrypt_twice_says_already_encrypted(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    make_store(store / "memory.sqlite3", None)
    r = _cli("rekey", "--encrypt", "--store", str(store), env={enc.ENV_KEY: KEY})
    assert r.returncode == 0 and "encrypted 1 of 1 store file" in r.stdout, r.stderr
    r = _cli("rekey", "--encrypt", "--store", str(store), env={enc.ENV_KEY: KEY})
    assert r.returncode == 1, r.stdout
    assert "already encrypted" in r.stderr and "encrypted 0 of" not in r.stdout
    assert KEY not in r.stdout + r.stderr


# =============================================== the same on real mounts (root only, optional)
@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at ``tmp_path/mnt`` (skips unless root can mount here); unmounted after."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=False)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_and_read_only_mounts(tmpfs: Path) -> None:
    store = tmpfs / "st"
    make_store(store / "memory.sqlite3", KEY)
    with (tmpfs / "pad").open("wb") as f:  # fill the disk
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with pytest.raises(StoreFullError, match="the disk is full"):
        open_store(str(store), key=KEY, writer=False)
    with pytest.raises(StoreFullError, match="cannot claim store"):
        open_store(str(store), key=KEY)
    (tmpfs / "pad").unlink()
    open_store(str(store), key=KEY, writer=False).close()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with pytest.raises(StoreError, match="its file system is read-only") as err:
        open_store(str(store), key=KEY, writer=False)
    assert WRONG_KEY not in str(err.value)
