"""An interrupted ``rekey`` says which key the store is under now, and SIGTERM stops it as
Ctrl-C does: the store-sized ``memory.sqlite3.rekey-tmp`` copy is removed before it exits.

The stop is sent by the rekey process to itself right after the copy of the chosen file is
written (a patched ``_export``), so the moment is exact, not a race with a timer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sqlcipher3")

from test_rekey_messages import NEW, OLD, _env, _run, _store  # noqa: F401 (_env: autouse)

from memoryos_gpu.store import encryption as enc

_DRIVER = """
import os, signal, sys, time
from memoryos_gpu.store import encryption as enc
real, calls = enc._export, []
def export(src, old, dst, new):
    real(src, old, dst, new)  # the copy is on disk, beside the store
    calls.append(src)
    if len(calls) == int(os.environ["STOP_AT"]):
        os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIG"]))
        time.sleep(5)  # the handler runs here
enc._export = export
from memoryos_gpu.cli.app import main
sys.exit(main(sys.argv[1:]))
"""


def _rekey_stopped(tmp_path: Path, store: Path, sig: str, at: int) -> subprocess.CompletedProcess:
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER, encoding="utf-8")
    env = {**os.environ, enc.ENV_KEY: OLD, enc.ENV_NEW_KEY: NEW, "STOP_SIG": sig}
    env["STOP_AT"] = str(at)
    return subprocess.run(
        [sys.executable, str(driver), "rekey", "--store", str(store)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _leftovers(store: Path) -> list[Path]:
    return sorted(store.rglob(f"*{enc.REKEY_SUFFIX}*"))


def _opens(store: Path, key: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setenv(enc.ENV_KEY, key)
    return _run("stats", "--store", store).exit_code == 0


def test_sigterm_stops_like_ctrl_c_removes_the_copy_and_says_the_store_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)
    done = _rekey_stopped(tmp_path, store, "SIGTERM", at=1)
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert "interrupted (SIGTERM): store unchanged, still under the current key" in done.stderr
    assert _leftovers(store) == []  # no store-sized copy left for the next writer
    assert _opens(store, OLD, monkeypatch)


def test_ctrl_c_between_shards_says_how_many_are_under_the_new_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path, workers=2)
    done = _rekey_stopped(tmp_path, store, "SIGINT", at=2)  # shard-0 done, shard-1 copied
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert (
        "interrupted: 1 of 2 shards under the new key; run rekey again with both keys "
        f"({enc.ENV_KEY}=old {enc.ENV_NEW_KEY}=new) to finish"
    ) in done.stderr
    assert _leftovers(store) == []
    monkeypatch.setenv(enc.ENV_NEW_KEY, NEW)
    res = _run("rekey", "--store", store)  # the way out it names works
    assert res.exit_code == 0, res.output
    monkeypatch.delenv(enc.ENV_NEW_KEY)
    assert _opens(store, NEW, monkeypatch)


def test_a_stop_after_the_rename_counts_that_file_as_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path, workers=2)
    real = enc._replace

    def replace_then_stop(tmp: str, path: str) -> None:
        real(tmp, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(enc, "_replace", replace_then_stop)
    files = sorted(store.glob("shard-*/memory.sqlite3"))
    with pytest.raises(enc.RekeyInterrupted) as stopped:
        enc.rekey_all(files, enc.SecretStr(OLD), enc.SecretStr(NEW))
    assert (stopped.value.done, stopped.value.total) == (1, 2)
    assert "1 of 2 shards under the new key" in stopped.value.state
    assert _leftovers(store) == []
