"""``bench`` refuses sizes whose arena would not fit in memory before allocating anything, and
a failed allocation is one ``error:`` line, not a traceback (CLI report defect #3)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from memoryos_gpu.cli import cli, measure


def _bench(*args: object) -> Result:
    return CliRunner().invoke(cli, ["bench", "--repeat", "1", *map(str, args)])


def test_sizes_beyond_the_address_space_are_a_usage_error() -> None:
    """Was: exit 1 and a traceback (RuntimeError: cannot reserve 983040000000000000 bytes)."""
    res = _bench("--users", 100_000_000, "--slots", 100_000, "--device", "cpu")
    assert res.exit_code == 2, res.output
    assert "--users 100000000 x --slots 100000 x --pages-per-segment 2" in res.stderr
    assert "of memory, and this machine has" in res.stderr
    assert "Traceback" not in res.output


def test_sizes_beyond_the_machines_memory_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is against the machine's memory: here made 64 MiB, which the defaults
    (1,000 users x 64 segments x 2 pages, ~0.3 GB of arena) do not fit."""
    monkeypatch.setattr(measure, "_host_memory", lambda: 64 << 20)
    res = _bench("--device", "cpu")
    assert res.exit_code == 2, res.output
    assert "this machine has 64 MiB; give smaller sizes" in res.stderr


def test_a_failed_allocation_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: object) -> None:
        raise MemoryError("Unable to allocate 23.8 GiB for an array")

    monkeypatch.setattr(measure, "_run_bench", no_memory)
    res = _bench("--users", 10, "--slots", 4, "--device", "cpu")
    assert res.exit_code == 1, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bench could not build"), lines
    assert "(10 users x 4 segments x 2 pages on cpu): Unable to allocate 23.8 GiB" in lines[0]


def test_one_of_each_is_singular() -> None:
    res = _bench("--users", 1, "--slots", 1, "--pages-per-segment", 1, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("cpu: 1 user x 1 segment x 1 page, batch 1: ")  # was: 1 users
