"""CLI arguments that are wrong in themselves (a bad ``--user``, bytes that are not UTF-8 in a
store or input path, a file that is not a store): each is refused the same way by every
command, before anything is written (tester's report, defects 2, 10, 14 and 15)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from cli_runs import run_cli, sample_store

from memoryos_gpu.cli.options import CLIError, handle_errors
from memoryos_gpu.formats import sample_chats_path

SURROGATE = "\udcff"  # what a 0xFF byte of argv becomes in Python (surrogateescape)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_store(tmp_path_factory.mktemp("argument_checks"))


def _user_commands(store: Path, user: str) -> dict[str, list[object]]:
    """Every command that takes ``--user``, as run on ``store`` for ``user``."""
    common = ["--store", store, "--user", user]
    return {
        "retrieve": ["retrieve", *common, "where?"],
        "chat": ["chat", *common, "-m", "hi"],
        "profile": ["profile", *common],
        "export": ["export", *common],
        "delete": ["delete", *common, "--yes"],
    }


@pytest.mark.parametrize(
    "user",
    ["", "   ", "u" * 300, SURROGATE, "a\x07b"],
    ids=["empty", "blank", "too-long", "surrogate", "control"],
)
def test_a_bad_user_id_is_the_same_usage_error_for_every_command(store: Path, user: str) -> None:
    messages = set()
    for name, args in _user_commands(store, user).items():
        res = run_cli(*args)
        assert res.exit_code == 2, (name, res.output)
        assert not isinstance(res.exception, Exception), (name, res.exception)  # no traceback
        messages.add(res.output.strip().splitlines()[-1])
    assert len(messages) == 1, messages
    assert messages.pop().startswith("Error: Invalid value for '--user': user_id")


def test_a_non_utf8_store_path_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    bad = tmp_path / f"bad{SURROGATE}name"
    res = run_cli("ingest", "/dev/null", "--store", bad)
    assert res.exit_code == 2, res.output
    assert "not UTF-8" in res.output and "--store" in res.output
    assert list(tmp_path.iterdir()) == []


def test_a_non_utf8_input_file_name_is_refused_before_the_store_is_made(tmp_path: Path) -> None:
    src = tmp_path / f"f{SURROGATE}.jsonl"
    src.write_bytes(sample_chats_path().read_bytes())
    res = run_cli("ingest", src, "--store", tmp_path / "okst")
    assert res.exit_code == 2, res.output
    assert "input file" in res.output and "not UTF-8" in res.output
    assert not (tmp_path / "okst").exists()


def test_an_unexpected_unicode_encode_error_is_one_error_line() -> None:
    @handle_errors
    def encodes() -> None:
        f"x{SURROGATE}".encode()

    with pytest.raises(CLIError) as caught:
        encodes()
    assert "not UTF-8" in caught.value.format_message()
    assert isinstance(caught.value, click.ClickException)


@pytest.mark.parametrize("command", ["retrieve", "delete"])
def test_a_refused_non_store_file_keeps_no_lock_beside_it(tmp_path: Path, command: str) -> None:
    notes = tmp_path / "notastore.db"
    notes.write_text("my notes, not a database\n" * 100)
    extra = ["q"] if command == "retrieve" else ["--yes"]
    res = run_cli(command, "--store", notes, "--user", "maya_chen", *extra)
    assert res.exit_code == 1, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notastore.db"]


def test_rekey_on_a_missing_store_names_the_directory_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    res = run_cli("rekey", "--store", "nostore")
    assert res.exit_code == 1, res.output
    assert "--store nostore)" in res.output
    assert "memory.sqlite3" not in res.output


@pytest.mark.parametrize("command", ["stats", "retrieve"])
def test_a_missing_in_memory_store_offers_no_in_memory_ingest(command: str) -> None:
    extra = ["--user", "u", "q"] if command == "retrieve" else []
    res = run_cli(command, "--store", ":memory:", *extra)
    assert res.exit_code == 1, res.output
    assert "--store :memory:" not in res.output
    assert "--store DIR" in res.output
