"""A store spec's password never reaches output, and a libpq connection string is not taken
for a directory.

Found by an operator sweep: ``memoryos-gpu users`` printed a PostgreSQL URL with its password
in clear (its JSON is what a migration script writes to files), as did ``chat``'s hint for a
store without tables; and ``--store "host=... password=..."`` (libpq's keyword form) made a
local SQLite directory of that name, the password in it, while the operator believed the pages
went to PostgreSQL. The other commands already masked the URL (``store/pg_urls.redact``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError
from store_backends import Backend, make_backend

from memoryos_gpu import EngineConfig, MemoryEngine
from memoryos_gpu import cli as cli_mod

SECRET = "topsecret97"


def test_a_libpq_connection_string_is_refused_without_echoing_it(tmp_path: Path) -> None:
    spec = f"host=127.0.0.1 port=5432 dbname=m user=u password={SECRET}"
    with pytest.raises(ValidationError, match="libpq connection string") as err:
        EngineConfig(store=spec)
    assert SECRET not in str(err.value)
    res = CliRunner().invoke(cli_mod.cli, ["ingest", "/dev/null", "--store", spec])
    assert res.exit_code == 2 and "postgresql://" in res.output and SECRET not in res.output
    assert not list(tmp_path.iterdir()) and not Path(spec).exists()


@pytest.mark.parametrize("spec", ["store=1", "runs/a=b", "notes", "x.sqlite3"])
def test_paths_with_an_equals_sign_stay_paths(spec: str) -> None:
    assert EngineConfig(store=spec).store == spec


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Backend]:
    pytest.importorskip("psycopg")
    b = make_backend("postgres", tmp_path)
    try:
        yield b
    finally:
        b.cleanup()


def _with_password(url: str) -> str:
    """``url`` with a password in its authority (the test server trusts local users, so it is
    sent and ignored)."""
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{SECRET}@{host}"


def test_users_and_chat_mask_the_password(pg: Backend) -> None:
    run = CliRunner().invoke
    empty = _with_password(pg.spec("empty"))
    with MemoryEngine(EngineConfig(store=empty, embedder="hashing")):
        pass  # the tables, no user
    res = run(cli_mod.cli, ["users", "--store", empty])
    assert res.exit_code == 0 and "no users in" in res.output, res.output
    assert SECRET not in res.output and ":***@" in res.output
    filled = _with_password(pg.spec("filled"))
    with MemoryEngine(EngineConfig(store=filled, embedder="hashing")) as e:
        e.add("u", "hello", "hi")
    res = run(cli_mod.cli, ["users", "--store", filled, "--json"])
    assert res.exit_code == 0, res.output
    assert SECRET not in res.output and json.loads(res.output)["count"] == 1
    bare = _with_password(pg.spec("bare"))  # a schema without tables
    llm = ["--llm-mode", "llm", "--llm-backend", "openai", "--llm-model", "m"]
    llm += ["--llm-base-url", "http://127.0.0.1:9/v1"]  # never reached: the store is refused
    res = run(cli_mod.cli, ["chat", "--store", bare, "--user", "u", *llm, "-m", "hi"])
    assert res.exit_code != 0 and "ingest /dev/null --store" in res.output, res.output
    assert SECRET not in res.output
