"""Instructions executed per ingested page, counted by callgrind: a measure the host cannot move.

Why: on the shared 2-core VMs this project is measured on, two runs of the same code differ by
up to +-25 % in wall time (benchmarks/README.md), more than most single changes to the write
path. The instructions a run executes hardly move between runs of the same code and input
(``valgrind --tool=callgrind``, ``PYTHONHASHSEED=0``, one OpenMP thread, derived work run
inline): two runs agree within ~1 % (timestamps written as text, what the clock decides), so
a change of a few percent shows. They are not time: a cache miss costs no instruction, so this
measures the interpreter, NumPy and SQLite work, not memory latency (use the timed benchmarks
for that).

Each workload ingests LoCoMo pages (the hashing embedder, the paper preset, an in-memory SQLite
store, ``add_many`` batches of 512 with derived work drained after each, as ``throughput.py``
does) in a child process under callgrind; the same child with no pages is the baseline
(imports, engine open and close), subtracted. In memory, not a file: a file store's
write-ahead log is checkpointed by a thread that wakes on a timer, whose instructions would
depend on how long the run takes (the file I/O itself is the kernel's, which callgrind does not
count either way). Reported: instructions per page for each workload, and in one run

* the per-page cost of one user's history (every derived wave holds one page) over that of
  many users' pages interleaved (waves of many pages): what a wave's fixed cost adds;
* with ``--base REV``: each workload's instructions on this tree over REV's (REV's Python
  files, this build's native extension: refused when ``csrc/`` differs).

    python benchmarks/instructions.py                      # 1 user x 300, 200 users x 20 pages
    python benchmarks/instructions.py --base HEAD~1        # and the change since HEAD~1
    python benchmarks/instructions.py --quick              # tiny workloads (CI)

Needs valgrind (``apt-get install valgrind``); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_env,
    check_output,
    machine_info,
    positive_int,
    run_main,
    today,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent


def locomo_path() -> Path:
    """The LoCoMo file the children read (throughput.DATA), without importing the package."""
    from memoryos_gpu.eval.locomo import default_locomo_path

    return default_locomo_path()


_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


# ============================================================================ child
def child(spec: dict[str, Any]) -> None:
    """Ingest ``users`` x ``pages`` LoCoMo pages (none for the baseline) with the code of
    ``spec["tree"]`` (None: the installed package)."""
    if spec.get("tree"):  # REV's Python files first: the editable install's finder goes
        sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in type(f).__module__]
        sys.path.insert(0, spec["tree"])
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput as T

    from memoryos_gpu.config import EngineConfig, preset
    from memoryos_gpu.engine import MemoryEngine

    corpus, _ = T.load_corpus(T.DATA)
    pages = T.make_pages(corpus, spec["users"], spec["pages"]) if spec["users"] else []
    cfg = EngineConfig(store=":memory:", memory=preset("paper"))
    engine = MemoryEngine(cfg, embedder=T.make_embedder("hashing"))
    try:
        if pages:
            T.ingest(engine, pages, 512)
    finally:
        engine.close()


def count(spec: dict[str, Any], workdir: Path) -> int:
    """Instructions the child executes for ``spec`` (valgrind's total for the process)."""
    out = workdir / "callgrind.out"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--child",
        json.dumps(spec),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    found = _COLLECTED.findall(p.stderr)
    if p.returncode != 0 or not found:
        raise RuntimeError(f"callgrind run failed ({p.returncode}): {p.stderr[-2000:]}")
    return int(found[-1])


# ============================================================================ trees
def base_tree(rev: str, workdir: Path) -> Path:
    """REV's ``memoryos_gpu`` beside this build's native extension, in ``workdir``."""
    changed = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", "csrc"], check=False
    ).returncode
    if changed:
        raise SystemExit(f"csrc/ differs from {rev}: its native extension is not this build's")
    tree = workdir / "base"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "memoryos_gpu"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    import memoryos_gpu._C as native

    shutil.copy(native.__file__, tree / "memoryos_gpu")
    return tree


# ============================================================================ runs
def measure(
    workloads: list[tuple[int, int]], tree: Path | None, workdir: Path
) -> list[dict[str, Any]]:
    tree_s = str(tree) if tree else None
    baseline = count({"users": 0, "pages": 0, "tree": tree_s}, workdir)
    rows = []
    for users, per_user in workloads:
        total = count({"users": users, "pages": per_user, "tree": tree_s}, workdir)
        pages = users * per_user
        rows.append(
            {
                "users": users,
                "pages_per_user": per_user,
                "pages": pages,
                "baseline": baseline,
                "instructions": total - baseline,
                "per_page": (total - baseline) / pages,
            }
        )
    return rows


def report(result: dict[str, Any]) -> None:
    print(f"{'tree':<10} {'users':>6} {'pages':>6} {'M instructions':>15} {'k per page':>11}")
    print("-" * 52)
    for name in ("this", "base"):
        for r in result.get(name) or []:
            print(
                f"{name:<10} {r['users']:>6} {r['pages']:>6} {r['instructions'] / 1e6:>15,.1f} "
                f"{r['per_page'] / 1e3:>11,.1f}"
            )
    for name, ratio in result["ratios"].items():
        print(f"{name}: {ratio:.3f}")


def ratios(this: list[dict[str, Any]], base: list[dict[str, Any]] | None) -> dict[str, float]:
    out = {}
    single = [r for r in this if r["users"] == 1]
    many = [r for r in this if r["users"] > 1]
    if single and many:
        out["one user's history / many users, instructions a page"] = (
            single[0]["per_page"] / many[-1]["per_page"]
        )
    for a, b in zip(this, base or [], strict=False):
        out[f"this / base, {a['users']} users x {a['pages_per_user']} pages"] = (
            a["per_page"] / b["per_page"]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--single",
        type=positive_int,
        default=None,
        help="pages of the one-user history (default 300; --quick: 12)",
    )
    ap.add_argument(
        "--users",
        type=positive_int,
        default=None,
        help="users of the interleaved workload (default 200; --quick: 4)",
    )
    ap.add_argument(
        "--pages-per-user",
        type=positive_int,
        default=None,
        help="pages per user of the interleaved workload (default 20; --quick: 5)",
    )
    ap.add_argument("--base", metavar="REV", help="also count git revision REV's Python code")
    ap.add_argument(
        "--quick", action="store_true", help="tiny workloads (CI): ~3 min on a 2-core CPU"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the report here (JSON)")
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    check_output(ap, args.json)  # a bad output path fails now, not after the run
    check_locomo_env(ap, locomo_path())  # the children read it: missing, one line
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind): nothing measured")
        return 0
    apply_defaults(
        args,
        full={"single": 300, "users": 200, "pages_per_user": 20},
        quick={"single": 12, "users": 4, "pages_per_user": 5},
    )
    workloads = [(1, args.single), (args.users, args.pages_per_user)]
    with tempfile.TemporaryDirectory(prefix="memoryos-instructions-") as tmp:
        workdir = Path(tmp)
        this = measure(workloads, None, workdir)
        base = measure(workloads, base_tree(args.base, workdir), workdir) if args.base else None
    result = {
        "benchmark": "instructions",
        "date": today(),
        "hardware": machine_info(),
        "settings": {**vars(args), "json": str(args.json) if args.json else None},
        "this": this,
        "base": base,
        "ratios": ratios(this, base),
    }
    report(result)
    if args.json:
        write_json(args.json, result, indent=1)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)
