"""The commands that measure: ``bench`` (the retrieval kernels on a synthetic arena) and
``eval`` (LoCoMo evidence recall against BM25)."""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from memoryos_gpu.sizes import size_text

from .memory import PAGE_COUNT
from .options import (
    CLIError,
    EngineOptions,
    UsageFailure,
    build_config,
    check_device,
    engine_options,
    handle_errors,
    make_engine,
    option_flag,
    options_of,
)
from .output import (
    echo_json,
    plural,
)

#: bench's default --batch (fewer users: every user)
_BENCH_BATCH = 256


class _BenchCommand(click.Command):
    """``bench``, whose parser says of an engine option after it (``bench --store X``) what
    the group says of one before it, instead of click's "No such option '--store'. Did you
    mean '--json'?"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if exc.option_name not in _ENGINE_FLAGS:
                raise
            raise _unused_by_bench([exc.option_name]) from None


def _unused_by_bench(flags: list[str]) -> UsageFailure:
    return UsageFailure(
        f"bench builds no engine and does not use {', '.join(flags)}: leave "
        f"{'it' if len(flags) == 1 else 'them'} out (bench takes only --device)"
    )


@click.command(cls=_BenchCommand)
@click.option("--users", type=click.IntRange(1), default=1000, show_default=True)
@click.option(
    "--slots", type=click.IntRange(1), default=64, show_default=True, help="Live segments per user."
)
@click.option("--pages-per-segment", type=click.IntRange(0), default=2, show_default=True)
@click.option(
    "--batch",
    type=click.IntRange(1),
    help="Queries per kernel call, each for a distinct user: at most --users "
    f"[default: {_BENCH_BATCH}, or --users when fewer].",
)
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    help="Where the arena and kernels run (auto: CUDA when usable).",
)
@click.pass_context
@handle_errors
def bench(
    ctx: click.Context,
    users: int,
    slots: int,
    pages_per_segment: int,
    batch: int | None,
    repeat: int,
    as_json: bool,
    device: str | None,
) -> None:
    """Quick retrieval-kernel benchmark (segment scoring + page top-k) on a synthetic arena.

    It builds no engine (no store, model, preset or LLM: a random arena of d=384), so of the
    engine options it takes only --device. Sizes whose arena would not fit in the machine's
    memory are refused before anything is allocated.

    The full benchmarks live in the source tree: benchmarks/kernel_speed.py (kernels vs a
    reference-style loop vs torch) and benchmarks/ingest.py (end-to-end ingestion)."""
    from memoryos_gpu import ops

    group = _bench_group_options(ctx)
    batch = _bench_batch(batch, users)
    device = device or group.device or "auto"
    if device == "auto":
        device = "cuda" if ops.build_info()["cuda_usable"] else "cpu"
    check_device(device)  # every command's rule: a usage error (exit 2), it exited 1
    _check_bench_fits(users, slots, pages_per_segment, device)
    try:
        build_s, med = _run_bench(users, slots, pages_per_segment, batch, repeat, device)
    except (MemoryError, RuntimeError) as exc:  # the estimate's margin, or another process
        raise CLIError(
            f"bench could not build or run its arena ({plural(users, 'user')} x "
            f"{plural(slots, 'segment')} x {plural(pages_per_segment, 'page')} on {device}): "
            f"{_one_line(exc)}"
        ) from None
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    result = {
        "device": device,
        "users": users,
        "segments_per_user": slots,
        "pages_per_segment": pages_per_segment,
        "batch": batch,
        "build_s": round(build_s, 3),
        "median_batch_ms": round(med * 1e3, 3),
        "queries_per_s": round(batch / med, 1),
        "native": ops.build_info(),
        "benchmarks": str(root) if root.is_dir() else None,
    }
    if as_json:
        echo_json(result)
        return
    click.echo(
        f"{device}: {plural(users, 'user')} x {plural(slots, 'segment')} x "
        f"{plural(pages_per_segment, 'page')}, batch {batch}: {med * 1e3:.2f} ms per batch = "
        f"{batch / med:,.0f} queries/s (score segments + top-10 pages)"
    )
    where = root if root.is_dir() else "benchmarks/ in the memoryos-gpu source tree"
    click.echo(f"full benchmarks: {where} (kernel_speed.py, ingest.py)")


#: bench's synthetic arena: embedding width, keyword row width, and the rows of random data
#: it generates at a time (segments and, separately, pages)
_BENCH_DIM, _BENCH_KW = 384, 16
_BENCH_CHUNK_ROWS = 1_000_000
#: what the process takes besides the arena (Python, NumPy, the native kernels): measured
#: 40-100 MB; bench's estimate counts this much
_BENCH_BASE_BYTES = 256 << 20


def _chunk_users(users: int, slots: int, pages_per_segment: int) -> int:
    """Users whose random segments and pages bench generates at a time: about
    ``_BENCH_CHUNK_ROWS`` rows of each, so the data waiting to be written stays a few GB
    whatever the sizes (it counted only segments: 64 users of 100,000 pages a segment asked
    for 9.8 TB at once)."""
    per_user = slots * max(1, pages_per_segment)
    return max(1, min(users, _BENCH_CHUNK_ROWS // per_user))


def _bench_bytes(users: int, slots: int, pages_per_segment: int, device: str) -> tuple[int, int]:
    """``(host bytes, device bytes)`` bench needs at its peak, an estimate on the high side:
    the arena's rows (embeddings fp32 on the host, fp16 on a GPU; keywords, statistics, block
    table, page pool and BM25 rows), the chunk of random data generated before it is written
    and the process itself. Measured against the peak resident memory on the CPU: 140 MiB
    for an estimate of 358 MiB (4,000 x 8 x 0), 6.1 GiB for 8.8 GiB (20,000 x 64 x 1).
    Device bytes are 0 on the CPU, where the arena lives in host memory."""
    on_cuda = device.startswith("cuda")
    emb = 2 if on_cuda else 4
    segments, pages = users * slots, users * slots * pages_per_segment
    arena = segments * (_BENCH_DIM * emb + _BENCH_KW * 4 + 48) + pages * (_BENCH_DIM * emb + 48)
    rows = _chunk_users(users, slots, pages_per_segment) * slots
    chunk = rows * (_BENCH_DIM * 4 + _BENCH_KW * 8 + 32) * (1 + 2 * pages_per_segment)
    if on_cuda:  # a growing pool copies on a GPU: old and new rows at once
        return _BENCH_BASE_BYTES + chunk + segments * 16, 2 * arena
    return _BENCH_BASE_BYTES + arena + chunk, 0


def _check_bench_fits(users: int, slots: int, pages_per_segment: int, device: str) -> None:
    """Refuse sizes whose arena would not fit in memory, before anything is allocated. Why: a
    typo in a size (one zero too many) ended in a traceback of a failed allocation, or had
    the OOM killer stop the process after it took every byte of the machine's memory."""
    host, dev = _bench_bytes(users, slots, pages_per_segment, device)
    for need, have, where in (
        (host, _host_memory(), "memory"),
        (dev, _device_memory(device) if dev else None, f"{device} memory"),
    ):
        if have is not None and need > have:
            raise UsageFailure(
                f"--users {users} x --slots {slots} x --pages-per-segment "
                f"{pages_per_segment}: the arena needs about {size_text(need)} of {where}, "
                f"and this machine has {size_text(have)}; give smaller sizes"
            )


def _host_memory() -> int | None:
    """The machine's physical memory in bytes, or the cgroup's limit when lower (a container's
    memory.max: what the OOM killer goes by); None when neither can be read."""
    import os

    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = int(Path(limit_file).read_text().strip())
        except (OSError, ValueError):  # absent, or "max": no limit
            continue
        total = limit if total is None else min(total, limit)
    return total


def _device_memory(device: str) -> int | None:
    """A CUDA device's total memory in bytes (None off CUDA or when torch cannot say)."""
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    except Exception:  # no answer is no check: building the arena then says what failed
        return None


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (a CUDA out-of-memory error spans several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _run_bench(
    users: int, slots: int, pages_per_segment: int, batch: int, repeat: int, device: str
) -> tuple[float, float]:
    """Build the random arena and time the kernels: ``(build seconds, median batch seconds)``."""
    import numpy as np

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    arena = _bench_arena(rng, users, slots, pages_per_segment, device)
    build_s = time.perf_counter() - t0
    return build_s, _median_batch_s(arena, rng, users, batch, repeat)


def _bench_arena(rng: Any, users: int, slots: int, pages_per_segment: int, device: str) -> Any:
    """An arena of ``users`` x ``slots`` random segments of ``pages_per_segment`` pages each."""
    import numpy as np

    from memoryos_gpu.arena import Arena, ArenaConfig

    dim, kw_width = _BENCH_DIM, _BENCH_KW
    arena = Arena(
        ArenaConfig(
            dim=dim,
            segment_slots=slots,
            keyword_width=kw_width,
            device=device,
            initial_users=users,
            initial_blocks=max(1, users * slots * -(-pages_per_segment // 16)),
        )
    )
    arena.add_users(users)
    chunk = _chunk_users(users, slots, pages_per_segment)
    for start in range(0, users, chunk):
        us = np.arange(start, min(users, start + chunk), dtype=np.int32)
        u, s = np.repeat(us, slots), np.tile(np.arange(slots, dtype=np.int32), us.size)
        emb = rng.standard_normal((u.size, dim), dtype=np.float32)
        kw = np.sort(rng.integers(0, 5000, size=(u.size, kw_width), dtype=np.int32), axis=1)
        kw[:, kw_width // 2 :] = -1
        arena.write_segments(u, s, emb, kw, l_interaction=np.full(u.size, pages_per_segment))
        if pages_per_segment:
            pu, ps = np.repeat(u, pages_per_segment), np.repeat(s, pages_per_segment)
            arena.append_pages(pu, ps, rng.standard_normal((pu.size, dim), dtype=np.float32))
    return arena


def _median_batch_s(arena: Any, rng: Any, users: int, batch: int, repeat: int) -> float:
    """The median seconds of one kernel call pair (score segments, top-10 pages) over
    ``repeat`` runs after a warm-up, for ``batch`` queries of distinct users."""
    import numpy as np

    from memoryos_gpu import ops

    q = rng.standard_normal((batch, _BENCH_DIM), dtype=np.float32)
    qu = rng.choice(users, size=batch, replace=False).astype(np.int32)
    qkw = np.sort(rng.integers(0, 5000, size=(batch, 8), dtype=np.int32), axis=1)

    def once() -> None:
        _, chosen = ops.score_segments(arena, q, qu, qkw, 5)
        ops.select_pages(arena, q, qu, chosen, 10)
        if arena.on_cuda:
            import torch

            torch.cuda.synchronize()

    once()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _bench_group_options(ctx: click.Context) -> EngineOptions:
    """The engine options given before ``bench`` (``memoryos-gpu --device cuda bench``): the
    group accepts them all for every subcommand, but bench uses only --device, so any other
    is refused rather than silently ignored (a --preset or --embedder there would suggest the
    numbers depend on it). The LLM API key is let through: it may come from the environment."""
    group = ctx.obj if isinstance(ctx.obj, EngineOptions) else EngineOptions()
    unused = [
        option_flag(name)
        for name, value in vars(group).items()
        if value is not None and name not in ("device", "llm_api_key")
    ]
    if unused:
        raise _unused_by_bench(unused)
    return group


#: the engine options' flags (the group's; bench takes only --device of them)
_ENGINE_FLAGS = frozenset(option_flag(f.name) for f in fields(EngineOptions) if f.name != "device")


def _bench_batch(batch: int | None, users: int) -> int:
    """``--batch``, whose queries are for distinct users (a kernel call over the same user
    twice is not the load it stands for): by default 256, or every user when there are fewer;
    a larger ``--batch`` than ``--users`` is refused rather than silently shrunk or repeated."""
    if batch is None:
        return min(_BENCH_BATCH, users)
    if batch > users:
        raise UsageFailure(
            f"--batch {batch} is more than --users {users}: each query of a batch is for a "
            f"distinct user; give --batch {users} or fewer, or more --users"
        )
    return batch


# ============================================================================ eval
@click.command(name="eval")
@click.argument("locomo_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--quick",
    is_flag=True,
    help="First conversation, first 40 questions (those without evidence are not scored, so "
    "fewer may be).",
)
@click.option(
    "--k",
    "ks",
    type=PAGE_COUNT,
    multiple=True,
    help="Page budgets (repeatable) [default: 5 10 20].",
)
@click.option("--json", "as_json", is_flag=True)
@engine_options
@click.pass_context
@handle_errors
def evaluate(
    ctx: click.Context,
    locomo_file: str,
    quick: bool,
    ks: tuple[int, ...],
    as_json: bool,
    **kwargs: Any,
) -> None:
    """LoCoMo evidence recall of the engine's retrieval vs BM25 (no LLM needed).

    Each conversation is ingested as one user, with the pages `ingest` makes of it (the
    speakers' names included), into an in-memory store (--store is not touched); each
    question is retrieved with heat updates off. Recall@k = fraction of a question's evidence
    turns among the first k pages (mid-term pages by score, then short-term pages newest
    first). Categories 1-4; a question without a valid evidence id is not scored, an evidence id
    that names no turn counts as a miss (both are reported)."""
    from memoryos_gpu.eval import evaluate_rankings, load_locomo, run_baselines
    from memoryos_gpu.extras import require

    require("rank_bm25", "eval", "the BM25 baseline")  # before the ingestion, not after it
    o = options_of(ctx, kwargs)
    k_list = sorted(set(ks)) or [5, 10, 20]
    try:
        convs = load_locomo(locomo_file)
    except ValueError as exc:
        raise UsageFailure(f"not a LoCoMo file: {exc}") from None
    if quick:
        convs = convs[:1]
        for c in convs:
            c.questions = c.questions[:40]
    if not any(q.scored for c in convs for q in c.questions):
        raise UsageFailure(
            f"{locomo_file} has no question of categories 1-4 with evidence: nothing to score"
        )
    t0 = time.perf_counter()
    pages, user_of = _locomo_pages(locomo_file, convs)
    cfg = build_config(o, store=":memory:")
    engine = make_engine(cfg)
    try:
        setup = {
            "embedder": engine.embedder.model_id,
            "preset": cfg.memory.preset,
            "device": "cuda" if engine.arena.on_cuda else "cpu",
        }
        for i in range(0, len(pages), 512):
            engine.add_many(pages[i : i + 512])
        engine.flush()
        ingest_s = time.perf_counter() - t0

        def rank(conv: Any, questions: list[Any]) -> list[list[int]]:
            rets = engine.retrieve_many(
                [(user_of[conv.sample_id], q.question) for q in questions],
                top_pages=max(k_list),
                update_heat=False,
            )
            out = []
            for r in rets:
                order = [p.extra.get("page_index") for p in r.pages]
                order += [p.extra.get("page_index") for p in reversed(r.stm)]
                seen: list[int] = []
                for i in order:
                    if isinstance(i, int) and i not in seen:
                        seen.append(i)
                out.append(seen)
            return out

        t1 = time.perf_counter()
        engine_rep = evaluate_rankings(convs, rank, k_list)
        retrieve_s = time.perf_counter() - t1
    finally:
        engine.close()
    bm25_rep = run_baselines(convs, None, k_list)["bm25"]
    any_rep = engine_rep[k_list[0]]
    result = {
        "file": locomo_file,
        "conversations": len(convs),
        "pages": len(pages),
        "questions": any_rep.n,
        # category 1-4 questions without a valid evidence id (not scored), evidence ids that
        # name no turn (counted as misses), ids that are not D<session>:<turn> (ignored)
        "questions_not_scored": any_rep.skipped_no_evidence,
        "evidence_ids_unmatched": any_rep.unmatched_evidence,
        "evidence_ids_malformed": any_rep.malformed_evidence,
        **setup,
        "ks": k_list,
        "ingest_s": round(ingest_s, 2),
        "retrieve_s": round(retrieve_s, 2),
        "recall": {
            name: {
                str(k): {
                    "overall": rep[k].overall,
                    "all_hit": rep[k].all_hit,
                    "per_category": {str(c): v for c, v in rep[k].per_category.items()},
                }
                for k in k_list
            }
            for name, rep in (("memoryos", engine_rep), ("bm25", bm25_rep))
        },
    }
    if as_json:
        echo_json(result)
        return
    not_scored = (
        f"; {plural(any_rep.skipped_no_evidence, 'question')} without evidence not scored"
        if any_rep.skipped_no_evidence
        else ""
    )
    click.echo(
        f"{plural(len(convs), 'conversation')}, {plural(len(pages), 'page')}, "
        f"{plural(any_rep.n, 'question')} (categories 1-4{not_scored}); "
        f"ingest {ingest_s:.1f} s, retrieval {retrieve_s:.1f} s"
    )
    click.echo(f"embedder {setup['embedder']}, preset {setup['preset']}, device {setup['device']}")
    if any_rep.unmatched_evidence or any_rep.malformed_evidence:
        click.echo(
            f"evidence: {plural(any_rep.unmatched_evidence, 'id')} naming no turn (each counted as "
            f"a miss), {plural(any_rep.malformed_evidence, 'malformed id')} (ignored; a "
            "question left without a valid id is not scored)"
        )
    click.echo("| retrieval | " + " | ".join(f"recall@{k}" for k in k_list) + " |")
    click.echo("| --- |" + " --- |" * len(k_list))
    for name, rep in (("memoryos (engine)", engine_rep), ("bm25", bm25_rep)):
        click.echo(f"| {name} | " + " | ".join(f"{rep[k].overall:.3f}" for k in k_list) + " |")


def _locomo_pages(path: str, convs: list[Any]) -> tuple[list[Any], dict[str, str]]:
    """The pages ``ingest`` makes of the conversations ``convs`` of the LoCoMo file ``path``
    (each :class:`~memoryos_gpu.eval.Conversation` in file order, from ``load_locomo``), and
    the user each conversation is stored under, by ``sample_id``.

    The pages are the reader's own records turned into pages as ingestion does
    (``Record.to_page``, with the record's meta), so the engine scored here is the one
    ``ingest`` builds: the meta carries the speakers' names, which the engine's page text is
    written with (``Nora: ... Ivan: ...``; without them it says ``User``/``Assistant``, and
    LoCoMo questions name people). The meta adds ``page_index``, the page's position in its
    conversation, which maps a retrieved page back to its evidence turns."""
    from memoryos_gpu.formats import Record
    from memoryos_gpu.formats.locomo import (
        iter_locomo_conversations,
        locomo_conversation_records,
    )
    from memoryos_gpu.types import PageInput

    pages: list[PageInput] = []
    user_of: dict[str, str] = {}
    # load_locomo read the same items in this order (``convs`` may stop early: --quick)
    for conv, (index, raw) in zip(convs, iter_locomo_conversations(path), strict=False):
        if not isinstance(raw, dict):  # load_locomo refused such a file: it changed since
            raise UsageFailure(f"not a LoCoMo file: {raw.path}: item {raw.line}: {raw.reason}")
        records = [
            r for r in locomo_conversation_records(raw, index, path) if isinstance(r, Record)
        ]
        for page, rec in zip(conv.pages, records, strict=True):
            pages.append(PageInput(**rec.to_page(), meta={**rec.meta, "page_index": page.index}))
        # a conversation without pages has no record to name its user: nothing to retrieve
        user_of[conv.sample_id] = records[0].user_id if records else conv.sample_id
    return pages, user_of
