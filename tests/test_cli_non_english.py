"""The CLI for users whose ids and memories are not English (testing report, F12 and F13): the
``users`` table lines up by display width when ids hold CJK characters, and a stdout whose
encoding cannot show a character (a GBK or Latin-1 console) neither fails a JSON output,
which is written as UTF-8 whatever the locale, nor fails the console script's text output;
where a stdout it does not own fails, the error names that encoding and the fix, not an
argument."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import click
import pytest
from cli_runs import HASHING, run_cli
from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli
from memoryos_gpu.cli.options import CLIError, handle_errors

RUNNER = "\U0001f3c3"  # an emoji: no legacy code page (GBK, Latin-1) has it
#: (user id, what the user said, what the assistant answered): ids of two wide characters
#: each and more, a Latin-1 one, an ASCII one
CHATS = [
    ("王小明", "我喜欢跑步。", RUNNER),
    ("用户_李", "我住在上海。", "上海很好。"),
    ("émilie", "J'habite à Lyon.", "Lyon est belle."),
    ("maya", "I bake bread.", "Nice."),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("non_english")
    chats = folder / "chats.jsonl"
    lines = [
        json.dumps({"user_id": u, "user_input": said, "agent_response": answer}, ensure_ascii=False)
        for u, said, answer in CHATS
    ]
    chats.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = run_cli("ingest", chats, "--store", folder / "st")
    assert res.exit_code == 0, res.output
    return folder / "st"


def display_width(text: str) -> int:
    """Terminal columns of ``text`` by Unicode's East Asian Width (W and F take two): the
    test's own measure, independent of the one the CLI pads by."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def run_with_encoding(encoding: str, *args: object) -> subprocess.CompletedProcess[bytes]:
    """The console script's entry point (``python -m memoryos_gpu``) with stdout in
    ``encoding``, as a legacy console (``PYTHONIOENCODING``) gives it."""
    env = {k: v for k, v in os.environ.items() if k not in HASHING}
    env |= {"MEMORYOS_GPU_EMBEDDER": "hashing", "PYTHONIOENCODING": encoding}
    return subprocess.run(
        [sys.executable, "-m", "memoryos_gpu", *map(str, args)],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )


def in_process(charset: str, *args: object) -> Result:
    """The command group in process on a strict stdout in ``charset`` (a caller's stream,
    which the console script's leniency does not reach)."""
    env = {**HASHING, "MEMORYOS_GPU_EMBEDDER": "hashing"}
    return CliRunner(charset=charset).invoke(cli, [str(a) for a in args], env=env)


# ======================================================================= F12: users table
def test_the_users_table_lines_up_by_display_width(store: Path) -> None:
    res = run_cli("users", "--store", store)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["user", *(u for u, _, _ in CHATS)]
    # the assistant column starts at one terminal column on every line
    assert len({display_width(re.match(r"\S+ +", line)[0]) for line in lines}) == 1, lines
    # the pages column, aligned right, ends at one terminal column on every line
    assert len({display_width(line.rsplit("  ", 1)[0]) for line in lines}) == 1, lines


def test_the_users_layout_is_the_old_one_in_terminal_columns(store: Path) -> None:
    """The same layout as before (ids and assistants left, pages right, two spaces apart), its
    widths counted in terminal columns instead of characters."""
    res = run_cli("users", "--store", store, "--json")
    rows = json.loads(res.stdout)["users"]
    table = [("user", "assistant", "pages", "newest page")] + [
        (r["user_id"], r["assistant_id"], f"{r['pages']:,}", r["last_time"]) for r in rows
    ]
    maya = next(i for i, row in enumerate(table) if row[0] == "maya")
    widths = [max(display_width(row[c]) for row in table) for c in range(3)]
    user, assistant, pages, last = table[maya]
    want = f"{user:<{widths[0]}}  {assistant:<{widths[1]}}  {pages:>{widths[2]}}  {last}"
    assert run_cli("users", "--store", store).stdout.splitlines()[maya] == want


# ======================================================================= F13: stdout's encoding
@pytest.mark.parametrize("encoding", ["gbk", "latin-1"])
def test_json_output_is_utf8_whatever_stdout_encoding(store: Path, encoding: str) -> None:
    export = run_with_encoding(encoding, "export", "--store", store, "--user", "王小明")
    assert export.returncode == 0, export.stderr.decode("utf-8", "replace")
    data = json.loads(export.stdout.decode("utf-8"))
    assert data["pages"][0]["agent_response"] == RUNNER
    listed = run_with_encoding(encoding, "users", "--store", store, "--json")
    assert listed.returncode == 0, listed.stderr.decode("utf-8", "replace")
    ids = [u["user_id"] for u in json.loads(listed.stdout.decode("utf-8"))["users"]]
    assert ids == [u for u, _, _ in CHATS]


def test_text_output_shows_what_stdout_cannot_encode_as_escapes(store: Path) -> None:
    shown = run_with_encoding("gbk", "retrieve", "--store", store, "--user", "王小明", "跑步")
    assert shown.returncode == 0, shown.stderr.decode("utf-8", "replace")
    text = shown.stdout.decode("gbk")
    assert "我喜欢跑步。" in text and "\\U0001f3c3" in text
    listed = run_with_encoding("latin-1", "users", "--store", store)
    assert listed.returncode == 0, listed.stderr.decode("utf-8", "replace")
    assert "\\u738b\\u5c0f\\u660e" in listed.stdout.decode("latin-1")
    assert "émilie" in listed.stdout.decode("latin-1")


def test_in_process_json_output_is_utf8_on_a_strict_gbk_stdout(store: Path) -> None:
    res = in_process("gbk", "retrieve", "--store", store, "--user", "王小明", "跑步", "--json")
    assert res.exit_code == 0, res.output
    pages = json.loads(res.stdout_bytes.decode("utf-8"))["pages"]
    assert [p["agent_response"] for p in pages] == [RUNNER]


def test_a_strict_stdout_that_cannot_show_text_is_named_with_the_fix(store: Path) -> None:
    res = in_process("gbk", "retrieve", "--store", store, "--user", "王小明", "跑步")
    assert res.exit_code == 1
    error = res.stderr.strip().splitlines()[-1]
    assert error.startswith("error: stdout's encoding (gbk) cannot show '\\U0001f3c3'"), error
    assert "PYTHONIOENCODING=utf-8" in error and "argument" not in error


def test_an_encoding_error_of_another_stream_names_its_encoding() -> None:
    @handle_errors
    def writes_latin1() -> None:
        "王".encode("latin-1")

    with pytest.raises(CLIError) as caught:
        writes_latin1()
    message = caught.value.format_message()
    assert "encoding (latin-1) cannot show '\\u738b'" in message
    assert "PYTHONIOENCODING=utf-8" in message and "not UTF-8" not in message
    assert isinstance(caught.value, click.ClickException)
