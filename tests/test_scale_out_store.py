"""``benchmarks/scale_out.py --store DIR|URL``: where the benchmark's stores go.

Why: benchmarks/README's multi-node recipe says to put the store where every node reaches it,
"the ``--store`` of ``ingest_ray``", but the script had no ``--store`` and always wrote into a
temporary directory of the driver's machine, which the shards on other nodes cannot see.

Most cases need no Ray (the run's steps are replaced by stubs that record the store each one
is given); one ``--quick`` run on a local Ray checks that the stores really land there, and
one case needs PostgreSQL (``$MEMORYOS_GPU_TEST_PG_URL``, skipped without it).
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from memoryos_gpu.distributed import ray_common

BENCH = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/scale_out.py as a module (it imports ``cli_args`` from its own folder)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("scale_out_bench", BENCH / "scale_out.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _FakeRay:
    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 2.0}


@pytest.fixture
def stubbed(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """No Ray, no engine: each step of the run records ``(step, store)``; a step also checks
    that its store's folder is there when it runs."""
    seen: list[tuple[str, str]] = []

    def record(step: str, store: str) -> None:
        if "://" not in store:
            assert Path(store).parent.is_dir(), f"{step}: no folder for {store}"
        seen.append((step, store))

    def ingest_single(src: Path, store: str, *_a: Any) -> dict:
        record("ingest_single", store)
        return {"shards": 0, "pages_per_s": 1.0}

    def ingest_sharded(src: Path, store: str, emb: str, shards: int, *_a: Any) -> dict:
        record(f"ingest_sharded-{shards}", store)
        return {"shards": shards, "pages_per_s": 1.0}

    def retrieve_single(store: str, *_a: Any) -> dict:
        record("retrieve_single", store)
        return {"shards": 0, "queries_per_s": 1.0}

    def retrieve_sharded(ray: Any, store: str, emb: str, shards: int, *_a: Any) -> dict:
        record(f"retrieve_sharded-{shards}", store)
        return {"shards": shards, "queries_per_s": 1.0}

    for fn in (ingest_single, ingest_sharded, retrieve_single, retrieve_sharded):
        monkeypatch.setattr(bench, fn.__name__, fn)
    monkeypatch.setattr(ray_common, "ensure_ray", lambda *a, **k: _FakeRay())
    return seen


def test_store_dir_reaches_every_step_and_is_kept(
    bench: ModuleType, stubbed: list[tuple[str, str]], tmp_path: Path
) -> None:
    store = tmp_path / "shared" / "scale-out"  # made by the run: its parent does not exist
    out = bench.main(["--quick", "--shards", "1", "2", "--store", str(store)])
    assert stubbed == [
        ("ingest_single", str(store / "single")),
        ("retrieve_single", str(store / "single")),
        ("ingest_sharded-1", str(store / "sharded-1")),
        ("retrieve_sharded-1", str(store / "sharded-1")),
        ("ingest_sharded-2", str(store / "sharded-2")),
        ("retrieve_sharded-2", str(store / "sharded-2")),
    ]
    assert store.is_dir()  # the user's: kept
    assert out["store"] == str(store)


def test_default_is_a_temporary_directory_removed_at_the_end(
    bench: ModuleType, stubbed: list[tuple[str, str]]
) -> None:
    out = bench.main(["--quick", "--shards", "2"])
    stores = {Path(s) for _, s in stubbed}
    assert {p.name for p in stores} == {"single", "sharded-2"}
    (work,) = {p.parent for p in stores}
    assert work.name.startswith("scale-out-") and not work.exists()
    assert out["store"] == "temporary directory"


def _through_a_file(tmp: Path) -> Path:
    (tmp / "f").write_text("x")
    return tmp / "f" / "store"


def _holding(label: str) -> Any:
    def make(tmp: Path) -> Path:
        (tmp / "s" / label).mkdir(parents=True)
        return tmp / "s"

    return make


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_through_a_file, "f is a file, not a directory"),
        (_holding("sharded-1"), "holds sharded-1 already"),
        (_holding("single"), "holds single already"),
    ],
    ids=["path-through-a-file", "sharded-store-exists", "baseline-store-exists"],
)
def test_bad_store_dir_refused_before_ray_starts(
    bench: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    make: Any,
    message: str,
) -> None:
    store = make(tmp_path)

    def no_ray(*_a: Any, **_k: Any) -> None:
        raise AssertionError("Ray was started before --store was checked")

    monkeypatch.setattr(ray_common, "ensure_ray", no_ray)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--quick", "--shards", "1", "--store", str(store)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: --store" in err and message in err


def test_unreachable_database_refused_before_ray_starts(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("psycopg", reason="psycopg is not installed")
    monkeypatch.setattr(ray_common, "ensure_ray", lambda *a, **k: pytest.fail("Ray started"))
    url = "postgresql://nobody:s3cret@127.0.0.1:1/nothing"
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--quick", "--store", url])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cannot connect to --store postgresql://nobody:***@127.0.0.1:1/nothing" in err
    assert "s3cret" not in err


def test_store_url_gives_each_store_a_schema(
    bench: ModuleType, stubbed: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database holds one shard layout: each store is a fresh schema of it, made by the run
    and kept; a second run over the same schemas is refused."""
    from store_backends import pg_url_or_skip

    url = pg_url_or_skip()
    import psycopg

    from memoryos_gpu.store import open_store

    prefix = f"scale_out_test_{uuid.uuid4().hex[:8]}_"
    monkeypatch.setattr(bench, "SCHEMA_PREFIX", prefix)
    schemas = [prefix + n for n in ("single", "sharded_1", "sharded_2")]
    try:
        out = bench.main(["--quick", "--shards", "1", "2", "--store", url])
        assert [s for _, s in stubbed][::2] == [
            bench.with_search_path(url, name) for name in schemas
        ]
        with psycopg.connect(url) as db:
            rows = db.execute(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", (prefix + "%",)
            ).fetchall()
        assert sorted(r[0] for r in rows) == sorted(schemas)
        store = open_store(stubbed[-1][1])  # the URL works in its schema
        try:
            assert store.query("SELECT current_schema()")[0][0] == schemas[-1]
        finally:
            store.close()
        assert out["store"] == url or "***" in out["store"]
        with pytest.raises(SystemExit):
            bench.main(["--quick", "--shards", "2", "--store", url])
    finally:
        with psycopg.connect(url, autocommit=True) as db:
            for name in schemas:
                db.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_quick_run_on_ray_writes_its_stores_under_store(
    bench: ModuleType, ray_local: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real thing, on a local Ray: every store of the run is under ``--store`` and kept
    (the baseline's SQLite file, the sharded store's manifest and shard)."""
    pytest.importorskip("ray.data", reason="Ray Data is not installed")
    store = tmp_path / "stores"
    out = bench.main(["--quick", "--shards", "1", "--store", str(store)])
    assert (store / "single" / "memory.sqlite3").is_file()
    assert (store / "sharded-1" / "shards.json").is_file()
    assert (store / "sharded-1" / "shard-0" / "memory.sqlite3").is_file()
    assert [row["pages"] for row in out["ingest"]] == [400, 400]
    assert out["store"] == str(store)
    assert f"stores kept in {store}" in capsys.readouterr().out
