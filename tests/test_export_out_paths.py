"""``export --out``: a symbolic link is followed, never replaced; a path that leads to an open
descriptor is written as it is; an error names the path given; ``--out ""`` is refused and
``--out -`` is stdout. (CLI report defects #1 and #13.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli
from memoryos_gpu.formats import sample_chats_path

USER = "maya_chen"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample chats ingested with the hashing embedder."""
    path = tmp_path_factory.mktemp("export") / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
        mp.delenv("MEMORYOS_GPU_STORE", raising=False)
        res = _run("ingest", sample_chats_path(), "--store", path)
    assert res.exit_code == 0, res.output
    return path


def _run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _export(store: Path, out: object) -> Result:
    return _run("export", "--store", store, "--user", USER, "--out", out)


def _is_export(text: str) -> bool:
    data = json.loads(text)
    return data["user"]["user_id"] == USER and len(data["pages"]) == 25


def test_a_link_to_a_file_is_followed_and_stays_a_link(store: Path, tmp_path: Path) -> None:
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text('{"old": true}\n')
    target.chmod(0o640)
    link.symlink_to("target.json")
    res = _export(store, link)
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and os.readlink(link) == "target.json"  # was: a regular file
    assert _is_export(target.read_text())  # was: left {"old": true}
    assert (target.stat().st_mode & 0o777) == 0o640  # the file replaced keeps its permissions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]


def test_a_dangling_link_creates_its_target(store: Path, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    link = tmp_path / "link.json"
    link.symlink_to("sub/new.json")
    assert _export(store, link).exit_code == 0
    assert link.is_symlink() and _is_export((tmp_path / "sub" / "new.json").read_text())


def test_a_missing_directory_is_named_as_given(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "nodir" / "x.json"
    res = _export(store, out)
    assert res.exit_code == 1
    assert f"error: cannot write {out}: No such file or directory" in res.stderr
    assert ".tmp" not in res.stderr  # was: named the temporary file


def test_an_open_descriptor_is_written_as_it_is(store: Path, tmp_path: Path) -> None:
    """``--out /proc/self/fd/1`` with stdout sent to a file (a subprocess: its own fd 1): the
    export lands in that file, after what the process's stdout held. Was: a temporary file
    in /proc/self/fd/, refused, exit 1, the file left empty."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd")
    out = tmp_path / "out.json"
    env = {**os.environ, "MEMORYOS_GPU_EMBEDDER": "hashing"}
    env.pop("MEMORYOS_GPU_STORE", None)
    args = ["export", "--store", str(store), "--user", USER, "--out", "/proc/self/fd/1"]
    with open(out, "w") as f:
        p = subprocess.run(
            [sys.executable, "-m", "memoryos_gpu", *args],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    assert p.returncode == 0, p.stderr
    assert _is_export(out.read_text())
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.json"]


def test_an_empty_out_is_refused_and_dash_is_stdout(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = _export(store, "")
    assert res.exit_code == 2 and "--out is empty" in res.stderr
    assert res.stdout == ""  # was: the export on stdout, as if --out were not given
    monkeypatch.chdir(tmp_path)
    res = _export(store, "-")
    assert res.exit_code == 0 and _is_export(res.stdout)
    assert not (tmp_path / "-").exists()  # was: a file named "-"
