"""One writer per store: a second writer is refused at open, naming the holder; the claim goes
with close and with the holder's death; read-only opens work beside it. Across real processes,
on SQLite and on PostgreSQL (per shard), and through the CLI (`ingest` beside `serve`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from store_backends import Backend, make_backend

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store import StoreLockedError, open_store
from memoryos_gpu.store.writer import Holder, command_line, lock_path

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()

# A child that claims a store (an engine, or the store alone with a shard), says "ready" and
# holds it until its stdin closes or says "close".
_HOLDER = """
import sys
from memoryos_gpu.store import open_store
spec, shard = sys.argv[1], sys.argv[2]
store = open_store(spec, shard=tuple(map(int, shard.split("/"))) if shard != "-" else None)
print("ready", flush=True)
sys.stdin.readline()
store.close()
print("closed", flush=True)
sys.stdin.readline()
"""


class Holding:
    """A child process holding a store's writer claim."""

    def __init__(self, spec: str, shard: str = "-") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, spec, shard],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "ready", self.proc.stderr.read()  # type: ignore[union-attr]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close_store(self) -> None:
        self.proc.stdin.write("close\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        assert self.proc.stdout.readline().strip() == "closed"  # type: ignore[union-attr]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def _open_eventually(spec: str, timeout: float = 10.0, **kw: object):
    """Open once the claim is free: PostgreSQL drops a killed client's session (and its locks)
    as soon as it sees the connection close, which takes a moment."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return open_store(spec, **kw)  # type: ignore[arg-type]
        except StoreLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _refused(spec: str, **kw: object) -> str:
    with pytest.raises(StoreLockedError) as info:
        open_store(spec, **kw)  # type: ignore[arg-type]
    return str(info.value)


# ====================================================================== both backends
def test_second_writer_in_another_process_is_refused_naming_it(backend: Backend) -> None:
    spec = backend.spec("held")
    open_store(spec).close()  # create the schema first (the child then only claims)
    child = Holding(spec)
    try:
        msg = _refused(spec)
        assert f"pid {child.pid} on {HOST}" in msg, msg
        assert "since 20" in msg and "-c" in msg, msg  # when, and the holder's command
        assert "POST /v1/pages" in msg  # what to do instead
        reader = open_store(spec, writer=False)  # a read-only open works beside it
        try:
            assert reader.counts()["users"] == 0
        finally:
            reader.close()
        child.close_store()
        open_store(spec).close()  # released on close
    finally:
        child.stop()


def test_claim_released_when_the_holder_is_killed(backend: Backend) -> None:
    spec = backend.spec("killed")
    open_store(spec).close()
    child = Holding(spec)
    try:
        _refused(spec)
        child.kill()
        _open_eventually(spec).close()
    finally:
        child.stop()


def test_second_engine_in_the_same_process_is_refused(backend: Backend) -> None:
    spec = backend.spec("same")
    cfg = EngineConfig(embedder="hashing", store=spec)
    first = MemoryEngine(cfg)
    try:
        first.add("alice", "hello")
        with pytest.raises(StoreLockedError, match="this process"):
            MemoryEngine(cfg)
    finally:
        first.close()
    second = MemoryEngine(cfg)  # the first one's close gave the store up
    try:
        assert second.users() == ["alice"]
    finally:
        second.close()


# ====================================================================== PostgreSQL: per shard
def test_postgres_shards_write_side_by_side_and_keep_others_out(tmp_path: Path) -> None:
    b = make_backend("postgres", tmp_path)
    try:
        spec = b.spec("shards")
        open_store(spec).close()
        s0 = Holding(spec, "0/2")
        s1 = Holding(spec, "1/2")  # another shard of the same layout: side by side
        try:
            msg = _refused(spec)  # the whole store: both shards hold it
            assert f"pid {s0.pid}" in msg and f"pid {s1.pid}" in msg, msg
            assert "shard 0/2" in msg and "shard 1/2" in msg, msg
            msg = _refused(spec, shard=(1, 2))
            assert msg.startswith("shard 1/2 of store") and f"pid {s1.pid}" in msg, msg
            msg = _refused(spec, shard=(2, 3))  # another layout: its users overlap
            assert "shard 0/2" in msg, msg
            s1.kill()
            _open_eventually(spec, shard=(1, 2)).close()
        finally:
            s0.stop()
            s1.stop()
        _open_eventually(spec).close()  # every shard gone: the whole store is free
    finally:
        b.cleanup()


# ====================================================================== SQLite details
def test_a_reader_beside_an_engine_cannot_write(tmp_path: Path) -> None:
    """``writer=False`` said "must not write" and let a program write: its delete_user beside
    a running engine succeeded, and the engine's next add for the user failed (FOREIGN KEY)."""
    import sqlite3

    store = str(tmp_path / "s")
    with MemoryEngine(EngineConfig(store=store, embedder="hashing")) as e:
        e.add("u", "hello there")
        reader = open_store(store, writer=False)
        try:
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                reader.delete_user("u")
            assert reader.query("SELECT COUNT(*) FROM pages WHERE user_id = 'u'") == [(1,)]
        finally:
            reader.close()
        e.add("u", "and again")  # the engine's memory and its store still agree
        assert [p.user_input for p in e.retrieve("u", "hello").stm] == ["hello there", "and again"]


def test_sqlite_lock_file_and_its_record(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"))
    path = lock_path(tmp_path / "s" / "memory.sqlite3")
    try:
        holder = Holder.from_json(path.read_text())
        assert holder is not None and holder.pid == os.getpid() and holder.host == HOST
    finally:
        store.close()
    assert path.exists() and path.read_text() == ""  # kept (waiters share it), record cleared
    link = tmp_path / "link.sqlite3"
    link.symlink_to(tmp_path / "s" / "memory.sqlite3")
    store = open_store(str(tmp_path / "s"))
    try:
        with pytest.raises(StoreLockedError):
            open_store(str(link))  # another path to the same database
    finally:
        store.close()
    open_store(":memory:").close()  # private to its connection: nothing to claim
    open_store(":memory:").close()


def test_an_open_for_writing_removes_what_a_killed_rekey_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``rekey`` killed before its rename leaves its copy of the store (about the store's
    size) and the copy's journal beside it; only a rerun of rekey removed them. Now the next
    open for writing does, once it holds the claim (a running rekey holds it, so the copy
    is a dead one's), and says so; a read-only open, which claims nothing, leaves them."""
    db = tmp_path / "s" / "memory.sqlite3"
    open_store(str(tmp_path / "s")).close()
    leftovers = [Path(f"{db}.rekey-tmp"), Path(f"{db}.rekey-tmp-journal")]
    for f in leftovers:
        f.write_bytes(b"\0" * 4096)
    open_store(str(tmp_path / "s"), writer=False).close()
    assert all(f.exists() for f in leftovers)
    with caplog.at_level("WARNING", logger="memoryos_gpu.store"):
        open_store(str(tmp_path / "s")).close()
    assert not any(f.exists() for f in leftovers)
    assert "interrupted rekey" in caplog.text and "memory.sqlite3.rekey-tmp-journal" in caplog.text


def test_holder_command_line_hides_secrets() -> None:
    line = command_line(
        [
            "/usr/bin/memoryos-gpu",
            "serve",
            "--store",
            "postgresql://me:hunter2@db/x",
            "--api-key",
            "sekrit",
            "--token=abc",
        ]
    )
    assert line.startswith("memoryos-gpu serve --store postgresql://me:***@db/x")
    assert "hunter2" not in line and "sekrit" not in line and "abc" not in line
    long = command_line(["x", "--store", "y" * 1000, "[engine process of pid 7]"])
    assert len(long) == 300 and long.startswith("x --store yyy") and " ... " in long
    assert long.endswith("[engine process of pid 7]")  # the end says which process holds it


def test_holder_command_line_keeps_no_user_data() -> None:
    """The record sits in plain beside an encrypted store (and names a PostgreSQL claim's
    session): a user id, a query or a chat log's name must not reach it, while the command
    and the settings that find the process (store, port, workers) stay."""
    line = command_line(
        ["memoryos-gpu", "retrieve", "--store", "s", "--user", "alice", "alice's diagnosis"]
    )
    assert line == "memoryos-gpu retrieve --store s --user ... ..."
    line = command_line(
        ["memoryos-gpu", "--store=s", "ingest", "--json", "alice.jsonl", "--workers=2", "--port"]
    )
    assert line == "memoryos-gpu --store=s ingest --json ... --workers=2 --port"
    line = command_line(["memoryos-gpu", "serve", "--port", "80", "[engine process of pid 7]"])
    assert line == "memoryos-gpu serve --port 80 [engine process of pid 7]"
    assert command_line(["x", "--user=[bob of pid 1]"]) == "x --user=..."


# ====================================================================== the CLI
def _serve(store: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MEMORYOS_GPU_EMBEDDER": "hashing"}
    env.pop("MEMORYOS_GPU_API_KEYS", None)
    # one process: the lock holder is the process started here (serve --workers: its engine
    # process, tests/test_serve_workers.py)
    cmd = ["serve", "--workers", "0", "--store", str(store), "--port", str(port)]
    return subprocess.Popen(
        [sys.executable, "-m", "memoryos_gpu", *cmd],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEMORYOS_GPU_EMBEDDER": "hashing"}
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_ingest_beside_a_running_server_is_refused(tmp_path: Path) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    store, chats = tmp_path / "store", tmp_path / "chats.jsonl"
    chats.write_text(
        '{"user_id": "alice", "user_input": "I live in Lisbon", "agent_response": "ok"}\n'
    )
    assert _cli("ingest", str(chats), "--store", str(store)).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _serve(store, port)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "server not ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = _cli("ingest", str(chats), "--store", str(store))
        assert r.returncode == 1, r.stderr
        assert "open for writing by" in r.stderr and f"pid {server.pid} on {HOST}" in r.stderr
        assert "serve" in r.stderr, r.stderr  # the holder's command
        stats = _cli("stats", "--store", str(store), "--json")  # read-only: works beside it
        assert stats.returncode == 0 and '"users": 1' in stats.stdout, stats.stderr
        deleted = _cli("delete", "--store", str(store), "--user", "alice", "--yes")
        assert deleted.returncode == 1 and "open for writing by" in deleted.stderr
        page = {"user_input": "and now I live in Porto"}
        assert (
            httpx.post(f"http://127.0.0.1:{port}/v1/users/alice/pages", json=page).status_code
            == 201
        )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        server.stderr.close()  # type: ignore[union-attr]
    r = _cli("ingest", str(chats), "--store", str(store))  # the server is gone: accepted
    assert r.returncode == 0, r.stderr


def test_a_deleted_lock_file_lets_no_second_writer_in(tmp_path: Path) -> None:
    """The lock file holds a pid, so an operator may take it for stale and delete it: a second
    writer, in another process or in this one, is still refused (the writer's byte lock on the
    database file), and the store opens once its writer has closed it."""
    spec = str(tmp_path / "s.sqlite3")
    open_store(spec).close()
    child = Holding(spec)
    try:
        lock_path(spec).unlink()
        with pytest.raises(StoreLockedError, match="whose lock file was deleted"):
            open_store(spec)  # was: let in, then "UNIQUE constraint failed" on its writes
        child.close_store()
        open_store(spec).close()
    finally:
        child.stop()
    first = open_store(spec)
    try:
        lock_path(spec).unlink()
        with pytest.raises(StoreLockedError, match="whose lock file was deleted"):
            open_store(spec)
        assert first.query("SELECT COUNT(*) FROM pages")[0][0] == 0  # still its own
    finally:
        first.close()
    open_store(spec).close()
