"""Encryption at rest for the SQLite store: how a store file is opened under a key, and how its
key is changed.

Why SQLCipher through ``sqlcipher3``: its connection is a drop-in for the ``sqlite3`` module's
(same DB-API, ``isolation_level``, ``in_transaction``, ``rowcount``), so an encrypted store is the
same :class:`~memoryos_gpu.store.sqlite.SQLiteStore` opened through another connect function,
with the same WAL mode, ``synchronous = FULL`` and ``secure_delete``. Every page of the database
and of its write-ahead log is encrypted (AES-256, HMAC-SHA512 per page, PBKDF2-HMAC-SHA512 with
256,000 iterations to derive the page key from the passphrase). docs/storage.md says why not
SQLite3 Multiple Ciphers (apsw).

A wrong or missing key is always a :class:`StoreError` at open, never an empty store: a key
given for a plain store, no key for an encrypted one, and a wrong key are told apart from the
file's first 16 bytes (a plain SQLite file starts with ``SQLite format 3``; an encrypted one with
its random salt). The key is handled as a :class:`pydantic.SecretStr` and never appears in a
message, a log line or a config dump.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.request import pathname2url

from pydantic import SecretStr

from memoryos_gpu.sizes import size_text
from memoryos_gpu.store.batched_sql import batched_connection
from memoryos_gpu.store.errors import StoreError, StoreFullError, disk_full, open_error

__all__ = [
    "ENV_KEY",
    "ENV_NEW_KEY",
    "REKEY_SUFFIX",
    "RekeyInterrupted",
    "as_secret",
    "connect",
    "env_key",
    "file_state",
    "rekey",
    "rekey_all",
    "remove_rekey_leftovers",
    "resolve_key",
]

#: The environment variable holding the store's key (read when no key is given explicitly).
ENV_KEY = "MEMORYOS_GPU_KEY"
#: The new key for ``memoryos-gpu rekey`` (prompted for when unset).
ENV_NEW_KEY = "MEMORYOS_GPU_NEW_KEY"
#: The copy :func:`rekey` writes beside a store (``memory.sqlite3.rekey-tmp``) before renaming
#: it over the store.
REKEY_SUFFIX = ".rekey-tmp"
_SQLITE_SIDECARS = ("", "-journal", "-wal", "-shm")
_PLAIN_HEADER = b"SQLite format 3\x00"
_EXTRA = "pip install 'memoryos-gpu[encryption]'"
_KEY_HELP = (
    f"${ENV_KEY} or a config file's encryption_key (in Python: EngineConfig(encryption_key=...))"
)


def env_key(name: str = ENV_KEY) -> SecretStr | None:
    """``$MEMORYOS_GPU_KEY`` (or the variable ``name``: ``rekey``'s new key) as a checked
    secret, None when unset. Set but empty (say ``MEMORYOS_GPU_KEY="$KEY"`` with ``$KEY``
    unset) is refused as an empty key given to the API is, rather than taken for "no key":
    that would write a plain store the operator meant to be encrypted (or prompt for a new key
    where a script meant to give one). The message names the variable, never its value."""
    value = os.environ.get(name)
    if value is None:
        return None
    secret = SecretStr(value)
    try:
        _check_key(secret)
    except StoreError as exc:
        hint = f"; unset ${name} for a store that is not encrypted" if not value else ""
        if name != ENV_KEY and not value:
            hint = f"; unset ${name} to be asked for the new key"
        raise StoreError(f"${name}: {exc}{hint}") from None
    return secret


def resolve_key(key: str | SecretStr | None) -> SecretStr | None:
    """The key to open a store with: ``key`` itself, else ``$MEMORYOS_GPU_KEY``, else None
    (not encrypted)."""
    return env_key() if key is None else as_secret(key)


def as_secret(key: str | SecretStr | None) -> SecretStr | None:
    """``key`` as a checked secret (None stays None). An empty key is refused rather than
    taken for "no key"."""
    if key is None:
        return None
    secret = key if isinstance(key, SecretStr) else SecretStr(key)
    _check_key(secret)
    return secret


def _check_key(key: SecretStr) -> None:
    """Refuse a key SQLCipher cannot take, before anything touches the disk (a refusal later
    would leave an empty store file and a claimed lock behind). A key from the environment
    that is not UTF-8 reaches Python as a str with lone surrogates, which no SQL text can
    carry. A key of only whitespace is refused as an empty one: it is what a variable holding
    a stray blank or newline gives, and accepted it encrypted a store, one way, under a key
    nobody meant."""
    value = key.get_secret_value()
    if not value:
        raise StoreError("the encryption key is empty")
    if not value.strip():
        raise StoreError("the encryption key is blank (only whitespace)")
    if "\x00" in value:
        raise StoreError("the encryption key contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise StoreError("the encryption key is not valid UTF-8 text") from None


def driver() -> ModuleType:
    """The SQLCipher DB-API module (``sqlcipher3.dbapi2``), or a StoreError naming the extra."""
    try:
        from sqlcipher3 import dbapi2
    except ImportError:
        raise StoreError(f"an encrypted store needs SQLCipher: {_EXTRA}") from None
    return dbapi2


def file_state(path: str | os.PathLike[str]) -> str:
    """``missing`` (no file, or an empty one: it is created as asked), ``plain`` (a SQLite file
    that is not encrypted) or ``encrypted`` (anything else: an encrypted store, or a file that
    is not SQLite at all; only a key tells them apart)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(len(_PLAIN_HEADER))
    except FileNotFoundError:
        return "missing"
    if not head:
        return "missing"
    return "plain" if head == _PLAIN_HEADER else "encrypted"


def _quote(key: SecretStr) -> str:
    """The key as an SQL string literal (PRAGMA key takes no bound parameter)."""
    return "'" + key.get_secret_value().replace("'", "''") + "'"


def _apply_key(db: Any, dbapi: ModuleType, path: str, key: SecretStr) -> None:
    """Key a fresh SQLCipher connection and prove the key right (the first read decrypts page 1);
    on failure the connection is closed and a StoreError raised.

    Only SQLITE_NOTADB ("file is not a database") after keying means a wrong key (or a file
    that is not a store): page 1 did not decrypt. Anything else -- a read-only file system
    (the ``-shm`` index cannot be created), a full disk, an I/O error -- is the machine's doing
    with the right key, and is said as a plain store's open says it."""
    try:
        db.execute("PRAGMA cipher_log_level = NONE")  # a wrong key is our error, not noise
        db.execute(f"PRAGMA key = {_quote(key)}")
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except dbapi.Error as exc:
        db.close()
        if _not_a_database(exc):
            raise StoreError(
                f"cannot decrypt store {path}: wrong encryption key (or the file is not a "
                f"store){_half_rekeyed(path, key)}"
            ) from None
        said = open_error(path, exc)
        raise said or StoreError(f"cannot open store {path}: {exc}") from exc
    except BaseException:
        db.close()
        raise


def _half_rekeyed(path: str, key: SecretStr) -> str:
    """The hint for a shard that ``key`` does not decrypt while another shard of its store
    does: ``rekey`` rewrites the shards one by one, so one stopped between two leaves some
    under each key, and every command then says "wrong key" whichever key it is given."""
    from memoryos_gpu.store import SHARDS_FILE

    shard = Path(path).parent
    if not shard.name.startswith("shard-") or not (shard.parent / SHARDS_FILE).is_file():
        return ""
    for other in sorted(shard.parent.glob("shard-*/memory.sqlite3")):
        if other.parent != shard and _decrypts(str(other), key):
            return (
                f"; but {other.parent.name} of this store opens with it: a `memoryos-gpu rekey` "
                f"stopped between shards? run it again with both keys (${ENV_KEY} the old one, "
                f"${ENV_NEW_KEY} the new one) to finish it"
            )
    return ""


def _decrypts(path: str, key: SecretStr) -> bool:
    """Whether ``key`` decrypts the first page of the encrypted file ``path`` (read only)."""
    if file_state(path) != "encrypted":
        return False
    dbapi = driver()
    try:
        db = dbapi.connect(f"file:{pathname2url(os.path.abspath(path))}?mode=ro", uri=True)
    except dbapi.Error:
        return False
    try:
        db.execute("PRAGMA cipher_log_level = NONE")
        db.execute(f"PRAGMA key = {_quote(key)}")
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return True
    except dbapi.Error:
        return False
    finally:
        db.close()


def _not_a_database(exc: BaseException) -> bool:
    """Whether a driver error is SQLITE_NOTADB, what a key that does not decrypt page 1 gives."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF == sqlite3.SQLITE_NOTADB
    return "file is not a database" in str(exc)


def connect(
    path: str, key: SecretStr | None, *, reopen: bool = False, **kwargs: Any
) -> tuple[Any, ModuleType]:
    """Open ``path`` (``kwargs`` as for :func:`sqlite3.connect`) under ``key`` (None: a plain
    store through the standard ``sqlite3``). Returns the connection and its DB-API module, whose
    exception classes the caller catches. Raises StoreError for a key that does not fit.

    ``reopen``: another connection of this process has the store open already; the file's
    header is then not read, because closing any descriptor of the file drops every POSIX lock
    the process holds on it, the open connection's included (another process would then take
    the file for unused and delete its write-ahead log)."""
    if reopen:
        state = "encrypted" if key is not None else "plain"
    else:
        state = "missing" if path == ":memory:" else file_state(path)
    if key is None:
        if state == "encrypted":
            raise StoreError(
                f"{path} is not a usable memoryos-gpu store without a key: it is encrypted "
                f"(give its key with {_KEY_HELP}) or it is not a SQLite file"
            )
        return sqlite3.connect(path, factory=batched_connection(sqlite3), **kwargs), sqlite3
    _check_key(key)  # a key given here directly (not through as_secret) is checked too
    if state == "plain":
        raise StoreError(
            f"store {path} is not encrypted, but an encryption key was given: encrypt it with "
            f"`memoryos-gpu rekey --encrypt --store ...` (one way), or open it without a key"
        )
    dbapi = driver()
    try:
        db = dbapi.connect(path, factory=batched_connection(dbapi), **kwargs)
    except dbapi.Error as exc:
        said = open_error(path, exc)
        raise said or StoreError(f"cannot open store {path}: {exc}") from None
    _apply_key(db, dbapi, path, key)
    return db, dbapi


def rekey(path: str | os.PathLike[str], old_key: SecretStr | None, new_key: SecretStr) -> None:
    """Rewrite the store ``path`` under ``new_key``; ``old_key`` None encrypts a plain store
    (one way: there is no decrypt). Refused while a writer holds the store.

    Crash-safe by construction: the store is copied (``sqlcipher_export``) to a temporary file
    beside it, checked and fsynced, then renamed over the original; a crash before the rename
    leaves the original untouched (the temporary file is removed by the next open for writing,
    :func:`remove_rekey_leftovers`), after it the new file is complete."""
    from memoryos_gpu.store.writer import SQLiteWriterLock

    path = os.fspath(path)
    _check_key(new_key)
    if old_key is not None:
        _check_key(old_key)
    want = "plain" if old_key is None else "encrypted"
    state = file_state(path)
    if state != want:
        raise StoreError(_rekey_refusal(path, state, encrypt=old_key is None))
    lock = SQLiteWriterLock(path)
    lock.acquire()
    try:
        # open it as a store first: a wrong key, a foreign database or a newer schema stop here
        _check_opens(path, old_key)
        tmp = f"{path}{REKEY_SUFFIX}"
        remove_rekey_leftovers(path)  # the claim did already where it can (not on Windows)
        try:
            _copy(path, old_key, tmp, new_key)
            _replace(tmp, path)
        except BaseException:
            # stopped (Ctrl-C, a SIGTERM taken as one) or failed between the copy and its
            # rename: the store is the old one; the copy (store-sized) goes now, under the
            # claim, not at the next writer's open. After the rename there is none to remove.
            remove_rekey_leftovers(path)
            raise
    finally:
        lock.release()


def remove_rekey_leftovers(path: str | os.PathLike[str]) -> list[tuple[Path, int]]:
    """Remove what a :func:`rekey` of the store ``path`` that died before its rename left
    beside it: the copy (``memory.sqlite3.rekey-tmp``, about the store's size) and its
    journal. Returns each removed file with its size in bytes; a file that cannot be removed
    stays (an ``OSError`` would fail an open that does not need it gone).

    Call it only while holding the store's writer claim (the claim does, at every open for
    writing: ``SQLiteWriterLock.acquire``): a rekey holds the claim from before it writes the
    copy until after the rename, so under the claim no rekey runs and any copy is a dead one's.
    Both the path as given and its real path are looked at (a store opened through a symlink
    has its copy beside the link)."""
    removed: list[tuple[Path, int]] = []
    bases = dict.fromkeys((os.fspath(path), os.path.realpath(path)))
    for base in bases:
        for side in _SQLITE_SIDECARS:
            leftover = Path(f"{base}{REKEY_SUFFIX}{side}")
            try:
                size = leftover.stat().st_size
                leftover.unlink()
            except OSError:  # none there (mostly), or not ours to remove
                continue
            removed.append((leftover, size))
    return removed


class AlreadyEncryptedError(StoreError):
    """An ``--encrypt`` (:func:`rekey_all` with ``old_key=None``) found every file already
    encrypted under the key given: nothing left to encrypt (``rekey --encrypt`` still finishes
    the rejects files of a run interrupted after the store's rename)."""


class RekeyInterrupted(KeyboardInterrupt):
    """A :func:`rekey_all` stopped by ``KeyboardInterrupt`` (Ctrl-C, or a SIGTERM / SIGHUP
    that ``memoryos-gpu rekey`` takes as one), saying where the store stands: :attr:`done` of
    :attr:`total` files are under the new key (those of an earlier run included), the others
    under the old one (or plain, for ``--encrypt``); the file in flight's copy is removed.
    :attr:`state` says it in words, with the way to finish."""

    def __init__(self, done: int, total: int, *, encrypt: bool) -> None:
        self.done, self.total, self.encrypt = done, total, encrypt
        super().__init__(self.state)

    @property
    def state(self) -> str:
        n, m = self.done, self.total
        if n == 0:
            return (
                "store unchanged, still not encrypted"
                if self.encrypt
                else "store unchanged, still under the current key"
            )
        if n >= m:
            what = "encrypted" if self.encrypt else "under the new key"
            return f"the rekey had finished: every store file is {what}" + (
                "" if self.encrypt else f" (open it with ${ENV_NEW_KEY}'s key from now on)"
            )
        if self.encrypt:
            return (
                f"{n} of {m} shards encrypted; run `rekey --encrypt` again with the same key "
                "to finish"
            )
        return (
            f"{n} of {m} shards under the new key; run rekey again with both keys "
            f"({ENV_KEY}=old {ENV_NEW_KEY}=new) to finish"
        )


def rekey_all(
    paths: list[str | os.PathLike[str]], old_key: SecretStr | None, new_key: SecretStr
) -> int:
    """:func:`rekey` over the files of one store (its shards), all or none as far as a wrong
    key goes: every file is checked before the first is rewritten. A file that already opens
    under ``new_key`` is skipped, so a run interrupted half way is finished by running it
    again. Returns how many files were rewritten.

    A ``KeyboardInterrupt`` (Ctrl-C; ``memoryos-gpu rekey`` takes SIGTERM and SIGHUP as one)
    comes out as :class:`RekeyInterrupted`, saying how many files are under which key; the
    copy of the file in flight is removed before it is raised."""
    files = [os.fspath(p) for p in paths]
    under_new = 0  # files under new_key now (an earlier run's, then this run's)
    current: str | None = None
    todo: list[str] | None = None
    try:
        todo = [p for p in files if not _opens_with(p, new_key)]
        if files and not todo and old_key is None:
            raise AlreadyEncryptedError(_already_encrypted(files))
        under_new = len(files) - len(todo)
        for path in todo:  # a wrong old key (or a plain/encrypted mix-up) stops before any write
            state = file_state(path)
            if state != ("plain" if old_key is None else "encrypted"):
                raise StoreError(_rekey_refusal(path, state, encrypt=old_key is None))
            _check_opens(path, old_key)
        for path in todo:
            current = path
            rekey(path, old_key, new_key)
            current = None
            under_new += 1
    except KeyboardInterrupt as exc:
        if isinstance(exc, RekeyInterrupted):
            raise
        if todo is None:  # stopped while looking: an earlier run may have done some files
            under_new = sum(_opens_with(p, new_key) for p in files)
        elif current is not None and _opens_with(current, new_key):
            under_new += 1  # stopped after its rename (fsyncing the directory)
        raise RekeyInterrupted(under_new, len(files), encrypt=old_key is None) from exc
    return len(todo)


def _check_opens(path: str, key: SecretStr | None) -> None:
    from memoryos_gpu.store.sqlite import SQLiteStore

    SQLiteStore(path, writer=False, key=key).close()


def _opens_with(path: str, key: SecretStr) -> bool:
    if file_state(path) != "encrypted":
        return False
    try:
        _check_opens(path, key)
    except StoreError:
        return False
    return True


def _already_encrypted(paths: list[str]) -> str:
    """The refusal of an ``--encrypt`` with nothing left to encrypt: every file already opens
    under the key given (run twice, or the store was encrypted before). Said as the refusal of
    any encrypted store, not as "encrypted 0 files", so a script sees it did nothing."""
    what = f"store {paths[0]} is" if len(paths) == 1 else f"all {len(paths)} store files are"
    return (
        f"{what} already encrypted (under this key); nothing to do: change its key with "
        "`memoryos-gpu rekey`"
    )


def _rekey_refusal(path: str, state: str, *, encrypt: bool) -> str:
    if state == "missing":
        return f"no store at {path}"
    if encrypt:
        return f"store {path} is already encrypted: change its key with `memoryos-gpu rekey`"
    return (
        f"store {path} is not encrypted: encrypt it with `memoryos-gpu rekey --encrypt` "
        f"(its current key comes from ${ENV_KEY})"
    )


def _copy(src: str, old_key: SecretStr | None, dst: str, new_key: SecretStr) -> None:
    """:func:`_export`, cleaned up when it fails (a disk without room for the copy, mostly):
    the partial copy is removed, the store is left as it was, and the driver's error becomes a
    StoreError (StoreFullError for a full disk) saying so."""
    try:
        _export(src, old_key, dst, new_key)
    except BaseException as exc:
        said = _copy_error(src, exc) if isinstance(exc, driver().Error) else None
        for side in _SQLITE_SIDECARS:
            Path(f"{dst}{side}").unlink(missing_ok=True)
        if said is not None:
            raise said from exc
        raise


def _copy_error(src: str, exc: BaseException) -> StoreError:
    """What a failed copy of ``src`` tells the operator (the store itself is unchanged)."""
    kept = "the store is unchanged (still under its current key) and the partial copy removed"
    if disk_full(exc, src):
        size = size_text(os.path.getsize(src))
        return StoreFullError(
            f"cannot rekey store {src}: the disk is full ({exc}); {kept}: rekey writes a copy "
            f"of the store beside it, so free at least {size} on that disk, then retry"
        )
    return StoreError(f"cannot rekey store {src}: {exc}; {kept}")


def _export(src: str, old_key: SecretStr | None, dst: str, new_key: SecretStr) -> None:
    """Copy every table of ``src`` into a new database ``dst`` encrypted under ``new_key``."""
    dbapi = driver()
    db = dbapi.connect(src, isolation_level=None, timeout=30.0)
    try:
        if old_key is not None:
            _apply_key(db, dbapi, src, old_key)
        busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise StoreError(
                f"store {src} is being read by another process (its write-ahead log cannot be "
                "emptied); stop the readers and run rekey again"
            )
        db.execute("ATTACH DATABASE ? AS rekeyed KEY ?", (dst, new_key.get_secret_value()))
        db.execute("SELECT sqlcipher_export('rekeyed')").fetchall()
        db.execute("DETACH DATABASE rekeyed")
    finally:
        db.close()  # the last connection: SQLite removes the (empty) -wal and -shm files
    out = dbapi.connect(dst, isolation_level=None)
    try:
        _apply_key(out, dbapi, dst, new_key)
        problems = [r[0] for r in out.execute("PRAGMA integrity_check").fetchall()]
        if problems != ["ok"]:
            raise StoreError(f"the re-encrypted copy of {src} fails its integrity check")
    finally:
        out.close()


def _replace(tmp: str, path: str) -> None:
    """Rename ``tmp`` over ``path`` durably (file and directory fsynced)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for side in ("-wal", "-shm"):  # an empty log of the old file must not meet the new one
        Path(path + side).unlink(missing_ok=True)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
