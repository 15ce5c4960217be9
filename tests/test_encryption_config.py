"""Where a command gets the store's key, and that the key reaches every process that opens it.

* ``serve --workers N [--engines K]`` hands each engine process its config through
  multiprocessing's spawn pipe: a JSON dump of it had written the key as ``**********``, so a
  new store was encrypted under those ten asterisks and an existing one did not open (503
  "wrong encryption key").
* The key of a ``--config`` file (``encryption_key``) is used by every command, the ones that
  open the store without an engine (stats, export, profile, delete, rekey) as well, and
  ``$MEMORYOS_GPU_KEY`` wins over it (docs/cli.md: flag > environment variable > config file;
  no flag carries a key), through one function, ``config.config_key``.

The key never shows in an output, a log or an error message."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

pytest.importorskip("sqlcipher3")

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.store import StoreError, open_store
from memoryos_gpu.store import encryption as enc
from tests.served import ROOT, free_port

KEY = "the-users-key-5b1e"
FILE_KEY = "the-files-key-0c7d"
MASK = "**********"  # what a JSON dump of a SecretStr writes
MARKER = "ZQXKEYPATHMARKER"
SECRETS = (KEY, FILE_KEY)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("MEMORYOS_GPU_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")


def fill(store: Path, key: str | None, user: str = "alice") -> None:
    """A closed store (a directory) of one user whose pages carry MARKER."""
    cfg = EngineConfig(store=str(store), embedder="hashing", device="cpu", encryption_key=key)
    engine = MemoryEngine(cfg)
    try:
        for i in range(3):
            engine.add(user, f"my {MARKER} number {i}", f"noted {i}", timestamp=float(i))
    finally:
        engine.close()


def opens_with(store: Path, key: str) -> bool:
    """Whether the store opens under ``key`` (False: wrong key)."""
    try:
        open_store(str(store), key=key, writer=False).close()
    except StoreError as exc:
        assert "wrong encryption key" in str(exc)
        return False
    return True


def pages_of(store: Path, key: str) -> list[str]:
    st = open_store(str(store), key=key, writer=False)
    try:
        return [text for (text,) in st.query("SELECT user_input FROM pages")]
    finally:
        st.close()


# ============================================================================ serve --workers
def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORYOS_GPU_")}
    return {**env, "MEMORYOS_GPU_EMBEDDER": "hashing", "OMP_WAIT_POLICY": "PASSIVE", **extra}


def _wait_ready(base: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until /ready answers 200; fails at once when the engine reports a wrong key."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        assert proc.poll() is None and "wrong encryption key" not in text, text[-3000:]
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready: {log.read_text()[-3000:]}")


@contextmanager
def serving(store: Path, log: Path, *flags: str, env: dict[str, str]) -> Iterator[httpx.Client]:
    """``memoryos-gpu serve --workers 1 FLAGS`` in a subprocess until SIGTERM (which drains the
    queues and closes the store); the log never holds the key."""
    port = free_port()
    cmd = [sys.executable, "-m", "memoryos_gpu", "serve", "--store", str(store)]
    cmd += ["--port", str(port), "--workers", "1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc, log)
        with httpx.Client(base_url=base, timeout=30) as client:
            yield client
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert not any(s in log.read_text() for s in SECRETS)


def _command_lines(log: Path) -> list[bytes]:
    """The command lines (visible to every user in ``ps``) of the processes the log started."""
    pids = re.findall(r"started \(pid (\d+)\)", log.read_text())
    assert len(pids) >= 2  # the engine process and the worker
    return [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids]


def _add(client: httpx.Client, user: str, text: str) -> None:
    r = client.post(f"/v1/users/{user}/pages", json={"user_input": text, "agent_response": "ok"})
    assert r.status_code in (200, 201), r.text
    assert client.post(f"/v1/users/{user}/wait", params={"timeout": 20}).json()["done"]


def test_serve_workers_encrypts_a_new_store_under_the_users_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = _child_env(MEMORYOS_GPU_KEY=KEY)
    with serving(store, tmp_path / "new.log", env=env) as client:
        _add(client, "alice", f"my {MARKER} is 4711")
        assert not any(KEY.encode() in cmdline for cmdline in _command_lines(tmp_path / "new.log"))
    db = store / "memory.sqlite3"
    assert not opens_with(db, MASK)  # the old engine process encrypted under the mask
    assert pages_of(db, KEY) == [f"my {MARKER} is 4711"]
    assert MARKER.encode() not in db.read_bytes()


def test_serve_workers_opens_an_existing_encrypted_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store, KEY)
    env = _child_env(MEMORYOS_GPU_KEY=KEY)
    with serving(store, tmp_path / "existing.log", env=env) as client:
        r = client.post("/v1/users/alice/retrieve", json={"query": MARKER})
        assert r.status_code == 200 and MARKER in r.text, r.text


def test_serve_engines_encrypts_every_shard_under_the_users_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    users = [f"user{i}" for i in range(6)]
    env = _child_env(MEMORYOS_GPU_KEY=KEY)
    with serving(store, tmp_path / "engines.log", "--engines", "2", env=env) as client:
        for user in users:
            _add(client, user, f"{user} says {MARKER}")
    shards = [store / f"shard-{i}" / "memory.sqlite3" for i in range(2)]
    assert all(not opens_with(db, MASK) for db in shards)
    texts = sorted(t for db in shards for t in pages_of(db, KEY))
    assert texts == sorted(f"{user} says {MARKER}" for user in users)


# ============================================================================ --config's key
def cli(*args: str) -> Result:
    """A command in this process (the environment as the test set it)."""
    from memoryos_gpu.cli import cli as group

    result = CliRunner().invoke(group, list(args))
    assert not any(s in result.output for s in SECRETS)
    return result


def config_file(tmp_path: Path, store: Path, key: str | None = FILE_KEY) -> str:
    path = tmp_path / "engine.toml"
    line = f'encryption_key = "{key}"\n' if key is not None else ""
    path.write_text(f'store = "{store}"\n{line}')
    return str(path)


#: every command family, each reading alice's pages from the store of the config file
READERS = {
    "stats": (["stats", "--json"], '"users": 1'),
    "export": (["export", "--user", "alice"], MARKER),
    "profile": (["profile", "--user", "alice", "--json"], '"user_id": "alice"'),
    "retrieve": (["retrieve", "--user", "alice", MARKER], MARKER),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_every_command_opens_the_store_with_the_config_files_key(tmp_path: Path, name: str) -> None:
    store = tmp_path / "store"
    fill(store, FILE_KEY)
    args, expected = READERS[name]
    r = cli(*args, "--config", config_file(tmp_path, store))
    assert r.exit_code == 0 and expected in r.output, r.output


@pytest.mark.parametrize("name", sorted(READERS))
def test_the_environment_key_wins_over_the_config_files(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    fill(store, KEY)
    monkeypatch.setenv(enc.ENV_KEY, KEY)
    args, expected = READERS[name]
    r = cli(*args, "--config", config_file(tmp_path, store, key="a-stale-key"))
    assert r.exit_code == 0 and expected in r.output, r.output


def test_ingest_encrypts_under_the_environment_key_before_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    chats = tmp_path / "chats.jsonl"
    chats.write_text(f'{{"user_id": "alice", "user_input": "{MARKER}", "agent_response": "ok"}}\n')
    monkeypatch.setenv(enc.ENV_KEY, KEY)
    r = cli("ingest", str(chats), "--config", config_file(tmp_path, store), "--no-progress")
    assert r.exit_code == 0, r.output
    db = store / "memory.sqlite3"
    assert pages_of(db, KEY) == [MARKER] and not opens_with(db, FILE_KEY)


def test_delete_uses_the_config_files_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store, FILE_KEY)
    r = cli("delete", "--user", "alice", "--yes", "--config", config_file(tmp_path, store))
    assert r.exit_code == 0 and "deleted user alice" in r.output, r.output
    assert pages_of(store / "memory.sqlite3", FILE_KEY) == []


def test_rekey_takes_the_current_key_from_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    fill(store, FILE_KEY)
    monkeypatch.setenv(enc.ENV_NEW_KEY, KEY)
    r = cli("rekey", "--config", config_file(tmp_path, store))
    assert r.exit_code == 0 and "re-keyed 1 of 1" in r.output, r.output
    assert len(pages_of(store / "memory.sqlite3", KEY)) == 3


def test_rekey_encrypt_uses_the_config_files_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store, None)
    r = cli("rekey", "--encrypt", "--config", config_file(tmp_path, store))
    assert r.exit_code == 0 and "encrypted 1 of 1" in r.output, r.output
    assert len(pages_of(store / "memory.sqlite3", FILE_KEY)) == 3


def test_without_any_key_an_encrypted_store_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store, FILE_KEY)
    r = cli("stats", "--config", config_file(tmp_path, store, key=None))
    assert r.exit_code == 1 and "give its key" in r.output, r.output


def test_a_key_that_is_not_a_string_is_a_usage_error_that_does_not_show_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(f'store = "{tmp_path / "store"}"\nencryption_key = 918273645\n')
    r = cli("stats", "--config", str(path))
    assert r.exit_code == 2 and "encryption_key must be a string" in r.output, r.output
    assert "918273645" not in r.output


def test_config_key_and_from_toml_follow_the_documented_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Python side of the same rule (the MCP server, `python -m memoryos_gpu.server` and
    Ray Serve read --config with from_toml): environment > file; a key given in Python wins."""
    from memoryos_gpu.config import config_key

    path = tmp_path / "engine.toml"
    path.write_text(f'encryption_key = "{FILE_KEY}"\n')

    def key_of(cfg: EngineConfig) -> str | None:
        return cfg.encryption_key.get_secret_value() if cfg.encryption_key else None

    assert config_key(None) is None
    assert config_key(FILE_KEY).get_secret_value() == FILE_KEY  # type: ignore[union-attr]
    assert key_of(EngineConfig.from_toml(path)) == FILE_KEY
    monkeypatch.setenv(enc.ENV_KEY, KEY)
    assert config_key(FILE_KEY).get_secret_value() == KEY  # type: ignore[union-attr]
    assert key_of(EngineConfig.from_toml(path)) == KEY
    assert key_of(EngineConfig.from_toml(path, encryption_key="from-python")) == "from-python"
