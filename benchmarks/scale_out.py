"""Scale-out: ingestion pages/s and retrieval queries/s with 1 and 2 shards on Ray.

What runs, for each shard count S (1, 2):

* **ingest**: ``ingest_ray`` (Ray Data partitions the logs by user hash onto S shard actors,
  then the keyword exchange and derived work) of the same synthetic JSONL, into a fresh store;
  pages/s = accepted pages / wall time, derived work included. The single-process
  ``memoryos_gpu.ingest`` (no Ray) runs the same input first, as the baseline.
* **retrieve**: S actors each open their shard's store (a ``ShardEngine``); the driver sends
  rounds of B queries (users drawn at random, each query to its user's shard, all shards at
  once) and waits for all; queries/s = queries / wall time. Baseline: one engine, same rounds.

On a 2-core machine two shards cannot be much faster than one: the embedder and the kernels
already use both cores, and Ray's actors and Data tasks share them. The point of sharding is
one shard per GPU (or per node); this script is how that is measured (see benchmarks/README.md,
"multi-GPU run").

Usage:
  python benchmarks/scale_out.py --quick --json /tmp/scale_out.json     # < 1 min (CI)
  python benchmarks/scale_out.py --json benchmarks/results/scale_out.json
  python benchmarks/scale_out.py --embedder minilm --shards 1 2 4 8 --users 2000   # GPU box
Options: --users, --pages (per user), --batch (queries per round), --rounds, --address (a Ray
cluster; default $RAY_ADDRESS, else local Ray with --num-cpus), --store (where the stores go).

Stores: by default under a temporary directory of this machine, removed at the end. On a
cluster of several nodes the shards run on other nodes, so the stores must be where every node
reaches them: ``--store DIR`` on a shared filesystem (``DIR/single``, ``DIR/sharded-S``) or
``--store postgresql://...`` (each store one schema of that database: ``scale_out_single``,
``scale_out_sharded_S``). Those are kept after the run, and a run refuses to start over one it
would write that exists already (it measures fresh stores). The input file is written and read
on this machine only (``ingest_ray`` reads it here and hands Ray the records).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_output,
    machine_info,
    positive_int,
    run_main,
    today,
    write_json,
)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TOPICS = [
    "hiking in the Alps with my dog",
    "my sister moved to Lisbon for a nursing job",
    "cello lessons every Tuesday evening",
    "we adopted a cat named Miso in March",
    "the new job at the bakery on Elm street",
    "rereading Dune every winter",
    "training for the Berlin marathon",
    "planting tomatoes and basil on the balcony",
]


def write_input(path: Path, users: int, pages: int) -> int:
    """Interleaved synthetic chats: ``users`` users x ``pages`` pages, topics drifting."""
    rng = random.Random(7)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for j in range(pages):
            for u in range(users):
                topic = TOPICS[(j // 4 + u) % len(TOPICS)]
                row = {
                    "user_id": f"u{u:05d}",
                    "user_input": f"About {topic}: note {j}, detail {rng.randint(0, 999)}.",
                    "agent_response": f"Thanks for telling me about {topic.split()[0]}.",
                    "timestamp": 1_700_000_000 + 3600 * j + u,
                    "assistant_id": f"a{u % 4}",
                }
                f.write(json.dumps(row) + "\n")
                n += 1
    return n


def engine_config(store: str, embedder: str) -> Any:
    from memoryos_gpu.config import EngineConfig

    return EngineConfig(
        embedder="hashing" if embedder == "hashing" else "transformers",
        store=store,
        device="auto",
    )


# ============================================================================ ingestion
def ingest_single(src: Path, store: str, embedder: str, batch: int) -> dict[str, Any]:
    from memoryos_gpu.engine import MemoryEngine
    from memoryos_gpu.ingest import ingest

    t0 = time.perf_counter()
    engine = MemoryEngine(engine_config(store, embedder).model_copy(update={"auto_process": False}))
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = ingest([src], engine, batch_size=batch, process="defer", progress=False)
    engine.flush()
    elapsed = time.perf_counter() - t0
    engine.close()
    return {
        "shards": 0,
        "pages": rep.accepted,
        "elapsed_s": round(elapsed, 3),
        "pages_per_s": round(rep.accepted / elapsed, 1),
        "model_load_s": round(load, 2),
    }


def ingest_sharded(src: Path, store: str, embedder: str, shards: int, batch: int) -> dict:
    from memoryos_gpu.distributed.ray_ingest import ingest_ray

    t0 = time.perf_counter()
    rep = ingest_ray([src], engine_config(store, embedder), shards, batch_size=batch)
    elapsed = time.perf_counter() - t0
    return {
        "shards": shards,
        "pages": rep["accepted"],
        "elapsed_s": round(elapsed, 3),
        "pages_per_s": round(rep["accepted"] / elapsed, 1),
        "timings": rep["timings"],
        "shard_cpus": rep["ray"]["shard_cpus"],
        "shard_gpus": rep["ray"]["shard_gpus"],
    }


# ============================================================================ retrieval
class RetrieveActor:
    """One shard's engine answering retrieve_many batches (a Ray actor)."""

    def __init__(self, config: dict[str, Any], shard: int, count: int) -> None:
        from memoryos_gpu.config import EngineConfig
        from memoryos_gpu.distributed.sharding import ShardEngine

        self.engine = ShardEngine(EngineConfig.model_validate(config), shard=shard, count=count)

    def retrieve(self, queries: list[tuple[str, str]]) -> int:
        return len(self.engine.retrieve_many(queries)) if queries else 0

    def close(self) -> None:
        self.engine.close()


def queries_for(users: int, batch: int, rounds: int) -> list[list[tuple[str, str]]]:
    rng = random.Random(11)
    return [
        [(f"u{rng.randrange(users):05d}", rng.choice(TOPICS)) for _ in range(batch)]
        for _ in range(rounds)
    ]


def retrieve_single(store: str, embedder: str, rounds: list) -> dict[str, Any]:
    from memoryos_gpu.engine import MemoryEngine

    engine = MemoryEngine(engine_config(store, embedder))
    engine.retrieve_many(rounds[0])  # warm-up (model, kernels)
    t0 = time.perf_counter()
    n = sum(len(engine.retrieve_many(r)) for r in rounds)
    elapsed = time.perf_counter() - t0
    engine.close()
    return {"shards": 0, "queries": n, "queries_per_s": round(n / elapsed, 1)}


def retrieve_sharded(ray: Any, store: str, embedder: str, shards: int, rounds: list) -> dict:
    from memoryos_gpu.distributed.layout import ShardMap, shard_store
    from memoryos_gpu.distributed.ray_common import shard_resources

    res = shard_resources(shards)
    cls = ray.remote(RetrieveActor)
    actors = [
        cls.options(**res.options()).remote(
            engine_config(shard_store(store, i, shards), embedder).model_dump(), i, shards
        )
        for i in range(shards)
    ]
    smap = ShardMap(shards)

    def one_round(batch: list[tuple[str, str]]) -> int:
        groups = smap.group(u for u, _ in batch)
        futures = [actors[s].retrieve.remote([batch[i] for i in idx]) for s, idx in groups.items()]
        return sum(ray.get(futures))

    one_round(rounds[0])  # warm-up
    t0 = time.perf_counter()
    n = sum(one_round(r) for r in rounds)
    elapsed = time.perf_counter() - t0
    ray.get([a.close.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    return {"shards": shards, "queries": n, "queries_per_s": round(n / elapsed, 1)}


# ============================================================================ stores
SCHEMA_PREFIX = "scale_out_"


def is_url(spec: str) -> bool:
    """A PostgreSQL ``--store`` (imported here: the engine's modules load after
    OMP_WAIT_POLICY is set, above)."""
    from memoryos_gpu.store import is_url as store_is_url

    return store_is_url(spec)


class Stores:
    """Where the benchmark's stores go (``--store``): a directory of this machine or a shared
    one, or a PostgreSQL database; see the module docstring.

    Why a class: the checks run before Ray starts (a bad ``--store`` is a one-line error
    at once, not after ~15 s of Ray start-up, or after the single-process baseline), and the
    stores are made one by one as the run reaches them."""

    def __init__(self, spec: str, labels: list[str], *, temporary: bool) -> None:
        self.spec = spec
        self.labels = labels
        self.temporary = temporary  # made by this run: removed at the end

    def describe(self) -> str:
        """The stores' place, as the report records it (a URL's password masked)."""
        if self.temporary:
            return "temporary directory"
        if is_url(self.spec):
            from memoryos_gpu.store.pg_urls import redact

            return redact(self.spec)
        return self.spec

    def check(self) -> None:
        """ValueError (one line) when the stores cannot be made there: a path through a file,
        a folder that cannot be written, an unreachable database, or a store this run would
        write that exists already."""
        if is_url(self.spec):
            self._check_database()
            return
        base = Path(self.spec)
        for at in (base, *base.parents):
            if at.exists():
                if not at.is_dir():
                    raise ValueError(f"--store {base}: {at} is a file, not a directory")
                break
        found = [label for label in self.labels if (base / label).exists()]
        if found:
            raise ValueError(
                f"--store {base} holds {', '.join(found)} already (the benchmark measures "
                "fresh stores): remove it or give another directory"
            )
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create --store {base}: {e.strerror or e}") from None
        if not os.access(base, os.W_OK):
            raise ValueError(f"cannot write --store {base}: permission denied")

    def _check_database(self) -> None:
        from memoryos_gpu.store.errors import StoreError
        from memoryos_gpu.store.pg_urls import check_url, redact

        try:
            check_url(self.spec)
            import psycopg
        except ImportError:
            raise ValueError(
                "--store postgresql://... needs psycopg: pip install 'memoryos-gpu[postgres]'"
            ) from None
        except StoreError as exc:
            raise ValueError(str(exc)) from None
        schemas = [self.schema(label) for label in self.labels]
        try:
            with psycopg.connect(self.spec, connect_timeout=10) as db:
                rows = db.execute(
                    "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)", (schemas,)
                ).fetchall()
        except psycopg.Error as exc:  # its words may quote the URL: only the first line
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"cannot connect to --store {redact(self.spec)}: {why}") from None
        if rows:
            raise ValueError(
                f"--store {redact(self.spec)} holds the schema(s) "
                f"{', '.join(sorted(r[0] for r in rows))} already (the benchmark measures "
                "fresh stores): drop them (DROP SCHEMA ... CASCADE) or use another database"
            )

    @staticmethod
    def schema(label: str) -> str:
        return SCHEMA_PREFIX + label.replace("-", "_")

    def make(self, label: str) -> str:
        """The store spec of ``label`` (``single``, ``sharded-S``): ``DIR/label`` (created by
        the engine), or the database URL working in a new schema of its own. A database is
        one store, and a store laid out for S shards refuses any other count: hence one
        schema per shard count."""
        if not is_url(self.spec):
            return str(Path(self.spec) / label)
        import psycopg
        from psycopg import sql

        name = self.schema(label)
        with psycopg.connect(self.spec, connect_timeout=10, autocommit=True) as db:
            db.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        return with_search_path(self.spec, name)

    def remove(self) -> None:
        """At the end: only a temporary directory (made by this run) is removed."""
        if self.temporary:
            shutil.rmtree(self.spec, ignore_errors=True)


def with_search_path(url: str, schema: str) -> str:
    """``url`` whose connections work in ``schema`` (libpq's ``options=-csearch_path=...``,
    replacing any ``options`` the URL had). The query is found after the credentials as
    libpq reads them (``pg_urls.credentials_end``), not by ``urllib.parse``, which a password
    with an unencoded ``?`` or ``#`` misleads."""
    from urllib.parse import quote

    from memoryos_gpu.store.pg_urls import credentials_end

    start = (credentials_end(url) or 0) + 1
    qmark = url.find("?", start)
    head, query = (url, "") if qmark < 0 else (url[:qmark], url[qmark + 1 :])
    pairs = [p for p in query.split("&") if p and p.partition("=")[0] != "options"]
    pairs.append("options=" + quote(f"-csearch_path={schema}", safe=""))
    return f"{head}?{'&'.join(pairs)}"


def store_labels(shards: list[int]) -> list[str]:
    """The stores a run writes: the single-process baseline's, then one per shard count."""
    return ["single", *dict.fromkeys(f"sharded-{s}" for s in shards)]


# ============================================================================ main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small input, CI-sized (< 1 min)")
    ap.add_argument("--users", type=positive_int, default=None, help="(default 400; --quick: 40)")
    ap.add_argument(
        "--pages", type=positive_int, default=None, help="pages per user (default 25; --quick: 10)"
    )
    ap.add_argument(
        "--shards",
        type=positive_int,
        nargs="+",
        default=[1, 2],
        help="shard counts to compare with the single process (default 1 2)",
    )
    ap.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="queries per retrieval round (default 64; --quick: 32)",
    )
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="retrieval rounds (default 40; --quick: 5)",
    )
    ap.add_argument(
        "--ingest-batch",
        type=positive_int,
        default=512,
        help="pages per ingest batch (default 512)",
    )
    ap.add_argument(
        "--embedder", choices=["hashing", "minilm"], default="hashing", help="(default hashing)"
    )
    ap.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    ap.add_argument("--num-cpus", type=positive_int, default=None, help="local Ray's CPUs")
    ap.add_argument(
        "--store",
        metavar="DIR|URL",
        default=None,
        help="where the stores go, kept after the run: a directory every node sees "
        "(DIR/single, DIR/sharded-S) or a PostgreSQL URL (a schema per store); "
        "default: a temporary directory here, removed at the end",
    )
    ap.add_argument(
        "--json", dest="json_out", metavar="OUT", default=None, help="write the results here (JSON)"
    )
    args = ap.parse_args(argv)
    check_output(ap, args.json_out)  # a bad output path fails now, not after the run
    apply_defaults(
        args,
        full={"users": 400, "pages": 25, "rounds": 40, "batch": 64},
        quick={"users": 40, "pages": 10, "rounds": 5, "batch": 32},
    )
    labels = store_labels(args.shards)
    if args.store is not None:
        stores = Stores(args.store, labels, temporary=False)
        try:
            stores.check()  # before Ray starts
        except ValueError as exc:
            ap.error(str(exc))

    from memoryos_gpu.distributed.ray_common import ensure_ray

    ray = ensure_ray(args.address, args.num_cpus)
    work = Path(tempfile.mkdtemp(prefix="scale-out-"))  # the input; the stores by default
    if args.store is None:
        stores = Stores(str(work), labels, temporary=True)
    try:
        src = work / "chats.jsonl"
        n = write_input(src, args.users, args.pages)
        rounds = queries_for(args.users, args.batch, args.rounds)
        single = stores.make("single")
        rows_ing = [ingest_single(src, single, args.embedder, args.ingest_batch)]
        rows_ret = [retrieve_single(single, args.embedder, rounds)]
        for s in dict.fromkeys(args.shards):
            store = stores.make(f"sharded-{s}")
            rows_ing.append(ingest_sharded(src, store, args.embedder, s, args.ingest_batch))
            rows_ret.append(retrieve_sharded(ray, store, args.embedder, s, rounds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        stores.remove()
    if not stores.temporary:
        print(f"stores kept in {stores.describe()}: {', '.join(labels)}")
    out = {
        "benchmark": "scale_out",
        "date": today(),
        "machine": {
            **machine_info(),
            "ray_cpus": ray.cluster_resources().get("CPU"),
            "ray_gpus": ray.cluster_resources().get("GPU", 0),
        },
        "input": {"users": args.users, "pages_per_user": args.pages, "pages": n},
        "embedder": args.embedder,
        "store": stores.describe(),
        "retrieval": {"batch": args.batch, "rounds": args.rounds},
        "ingest": rows_ing,
        "retrieve": rows_ret,
    }
    print_table(out)
    if args.json_out:
        write_json(args.json_out, out)
    return out


def print_table(out: dict[str, Any]) -> None:
    inp = out["input"]
    print(
        f"scale-out: {inp['users']} users x {inp['pages_per_user']} pages = {inp['pages']} pages,"
        f" {out['embedder']} embedder, Ray CPUs {out['machine']['ray_cpus']}, "
        f"GPUs {out['machine']['ray_gpus']}"
    )
    print(f"{'configuration':<28}{'ingest pages/s':>16}{'retrieve queries/s':>20}")
    for ing, ret in zip(out["ingest"], out["retrieve"], strict=True):
        name = "single process (no Ray)" if ing["shards"] == 0 else f"Ray, {ing['shards']} shard(s)"
        print(f"{name:<28}{ing['pages_per_s']:>16,.1f}{ret['queries_per_s']:>20,.1f}")


if __name__ == "__main__":
    run_main(main)
