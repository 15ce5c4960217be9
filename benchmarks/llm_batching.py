"""LLM batching: the same MemoryOS LLM work sent in cross-user batches vs one request at a time.

N users' conversations (LoCoMo dev pages, user ids rewritten) are ingested through the LLM
pipeline with the transformers backend (the bundled SmolLM2-135M by default). Measured in the same
run on the same pages:

- ``batched``: each stage's prompts of every user with pending work go to the backend together
  (``LLMConfig.batch_size``), as the engine always does;
- ``one-at-a-time``: ``batch_size = 1``, one request per backend call (the reference's way);

each in ``fused`` mode (one structured call per evicted page / promoted segment) and, with
``--separate``, in the paper's separate-call mode. Reported: model calls per page, mean batch size
per stage, pages/s, prompt and completion tokens per page, fallbacks, and the batched /
one-at-a-time throughput ratio. Batched runs then answer ``--responses`` questions per user
(``respond_many``: one retrieval pass, one response batch, the exchange remembered and its
derived work done) and report LLM calls, tokens and retrieval tokens per response, on the
paper's footing (MemoryOS reports 4.9 LLM calls and 3,874 retrieval tokens per response).

Usage: python benchmarks/llm_batching.py [--users 4] [--pages 8] [--max-tokens 48] [--quick]
       [--separate] [--json OUT]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cli_args import (
    Parser,
    apply_defaults,
    check_locomo_work,
    check_output,
    load_locomo_data,
    machine_info,
    positive_int,
    run_main,
    today,
    write_json,
)

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.eval.locomo import Conversation, default_locomo_path
from memoryos_gpu.types import PageInput

DEFAULT_DATA = default_locomo_path()


def user_questions(convs: list[Conversation], users: int, per_user: int) -> list[tuple[str, str]]:
    """``per_user`` LoCoMo questions for each user, from the conversation its pages came from."""
    out = []
    for u in range(users):
        conv = convs[u % len(convs)]
        out += [(f"user-{u}", q.question) for q in conv.scored_questions[:per_user]]
    return out


def synthetic_pages(convs: list[Conversation], users: int, pages: int) -> list[PageInput]:
    """``users`` users with ``pages`` consecutive LoCoMo pages each, interleaved by time."""
    out: list[PageInput] = []
    for u in range(users):
        conv = convs[u % len(convs)]
        start = (u // len(convs)) * pages
        for p in conv.pages[start : start + pages]:
            out.append(
                PageInput(
                    f"user-{u}",
                    p.user_input,
                    p.agent_response,
                    p.timestamp,
                    meta={"speaker_a": p.speaker_a, "speaker_b": p.speaker_b},
                )
            )
    return out


def warm_up(backend: Any) -> None:
    """Load the model and compile every stage's JSON grammar before anything is timed, so the
    first configuration measured does not pay for them."""
    from memoryos_gpu import prompts
    from memoryos_gpu.llm.base import ChatRequest

    page = {"user_input": "hi", "agent_response": "hello", "timestamp": 0.0}
    built = [
        prompts.fused_page(None, None, page),
        prompts.fused_promotion({}, [page]),
        prompts.continuity(page, page),
        prompts.chain_meta(None, page),
        prompts.topic_summary([page]),
        prompts.profile_update({}, [page]),
        prompts.user_knowledge([page]),
        prompts.assistant_knowledge([page]),
    ]
    backend.generate(
        [ChatRequest(messages=tuple(m), json_schema=s, max_tokens=4) for m, s in built]
    )


def run_one(
    pages: list[PageInput],
    backend: Any,
    *,
    fused: bool,
    batch_size: int,
    max_tokens: int,
    embedder: Any,
    workdir: Path,
    label: str,
    questions: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=3, tau=3.0),
        llm=LLMConfig(mode="llm", fused=fused, batch_size=batch_size, max_tokens=max_tokens),
        store=str(workdir / f"{label}.sqlite3"),
    )
    engine = MemoryEngine(cfg, embedder=embedder, llm=backend)
    t0 = time.perf_counter()
    engine.add_many(pages)
    engine.flush()
    seconds = time.perf_counter() - t0
    llm = engine.stats()["llm"]
    n = len(pages)
    responses = respond(engine, list(questions)) if questions else None
    engine.store.close()  # not engine.close(): the backend is shared between the runs
    row = {
        "mode": "fused" if fused else "separate",
        "batching": "batched" if batch_size > 1 else "one-at-a-time",
        "pages": n,
        "seconds": round(seconds, 2),
        "pages_per_s": round(n / seconds, 3),
        "llm_calls": llm["llm_calls"],
        "llm_calls_per_page": round(llm["llm_calls"] / n, 3),
        "prompt_tokens_per_page": round(llm["prompt_tokens"] / n, 1),
        "completion_tokens_per_page": round(llm["completion_tokens"] / n, 1),
        "fallbacks": llm["fallbacks"],
        "mean_batch_per_stage": {
            s: v["mean_batch"] for s, v in llm["per_stage"].items() if v["mean_batch"]
        },
    }
    if responses:
        row["per_response"] = responses
    return row


def respond(engine: MemoryEngine, questions: list[tuple[str, str]]) -> dict[str, Any]:
    """Answer ``questions`` in one respond_many batch, then finish the derived work their
    exchanges cause; LLM calls and tokens per response (everything a response costs)."""
    before = engine.stats()["llm"]
    tokens0 = engine.counters["retrieval_tokens"]
    t0 = time.perf_counter()
    out = engine.respond_many(questions)
    engine.flush()
    seconds = time.perf_counter() - t0
    after = engine.stats()["llm"]
    n = len(questions)
    return {
        "responses": n,
        "failed": sum(1 for r in out if getattr(r, "error", None)),
        "seconds": round(seconds, 2),
        "llm_calls": round((after["llm_calls"] - before["llm_calls"]) / n, 2),
        "prompt_tokens": round((after["prompt_tokens"] - before["prompt_tokens"]) / n, 1),
        "completion_tokens": round(
            (after["completion_tokens"] - before["completion_tokens"]) / n, 1
        ),
        "retrieval_tokens": round((engine.counters["retrieval_tokens"] - tokens0) / n, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LoCoMo file")
    p.add_argument("--users", type=positive_int, default=None, help="(default 4; --quick: 2)")
    p.add_argument(
        "--pages", type=positive_int, default=None, help="pages per user (default 8; --quick: 5)"
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="tokens per LLM call (default 48; --quick: 24)",
    )
    p.add_argument("--separate", action="store_true", help="also the paper's separate calls")
    p.add_argument("--responses", type=positive_int, default=1, help="questions answered per user")
    p.add_argument("--quick", action="store_true", help="2 users x 5 pages, 24 tokens")
    p.add_argument("--json", type=Path, default=None, help="write the report here (JSON)")
    args = p.parse_args(argv)
    check_output(p, args.json)  # a bad output path fails now, not after the run
    convs = load_locomo_data(p, args.data)  # a wrong file: one line now, not a traceback
    check_locomo_work(p, args.data, convs, scored=False)
    apply_defaults(
        args,
        full={"users": 4, "pages": 8, "max_tokens": 48},
        quick={"users": 2, "pages": 5, "max_tokens": 24},
    )
    from memoryos_gpu.embed import Embedder
    from memoryos_gpu.llm.transformers_backend import TransformersBackend

    embedder = Embedder()
    backend = TransformersBackend(batch_size=64)
    pages = synthetic_pages(convs, args.users, args.pages)
    questions = user_questions(convs, args.users, args.responses)
    warm_up(backend)
    rows = []
    modes = [True, False] if args.separate else [True]
    with tempfile.TemporaryDirectory() as tmp:
        for fused in modes:
            for batch in (64, 1):
                label = f"{'fused' if fused else 'separate'}-{batch}"
                rows.append(
                    run_one(
                        pages,
                        backend,
                        fused=fused,
                        batch_size=batch,
                        max_tokens=args.max_tokens,
                        embedder=embedder,
                        workdir=Path(tmp),
                        label=label,
                        questions=questions if batch > 1 else [],
                    )
                )
                print(f"{label} measured", file=sys.stderr, flush=True)
    ratios = {}
    for mode in {r["mode"] for r in rows}:
        b = next(r for r in rows if r["mode"] == mode and r["batching"] == "batched")
        o = next(r for r in rows if r["mode"] == mode and r["batching"] == "one-at-a-time")
        ratios[mode] = round(b["pages_per_s"] / o["pages_per_s"], 2)
    print(
        f"{'mode':<9} {'batching':<14} {'pages/s':>8} {'calls/page':>10} {'prompt tok/pg':>13} "
        f"{'fallbacks':>9}  mean batch per stage"
    )
    for r in rows:
        print(
            f"{r['mode']:<9} {r['batching']:<14} {r['pages_per_s']:>8.3f} "
            f"{r['llm_calls_per_page']:>10.3f} {r['prompt_tokens_per_page']:>13.1f} "
            f"{r['fallbacks']:>9}  {r['mean_batch_per_stage']}"
        )
    print(
        "batched / one-at-a-time throughput (> 1 = batching faster): "
        + ", ".join(f"{mode} {x:.2f}x" for mode, x in sorted(ratios.items()))
    )
    fell_back = sum(r["fallbacks"] for r in rows)
    if fell_back:
        print(
            f"warning: {fell_back} LLM call(s) fell back (no model output used), so the ratio "
            "above does not measure LLM batching"
        )
    for r in rows:
        if "per_response" in r:
            print(f"per response ({r['mode']}): {r['per_response']}")
    report = {
        "benchmark": "llm_batching",
        "date": today(),
        "machine": machine_info(),
        "users": args.users,
        "pages_per_user": args.pages,
        "max_tokens": args.max_tokens,
        "backend": "transformers (bundled SmolLM2-135M GGUF, CPU)",
        "results": rows,
        "throughput_ratio": ratios,
    }
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    run_main(main)
