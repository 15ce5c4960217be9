"""The worker-engine channel's own cost: CPU a message in the answering process.

``serve --workers`` carries every request between an HTTP worker and the engine process over
ZeroMQ (``memoryos_gpu.server.ipc``). The engine process is the one that bounds the server, so
what its side of the channel costs a message is taken from the engine's own work. This measures
that side alone, with no engine behind it: a ROUTER in its own process answers each message of
``--per-msg`` pickled retrieval requests with one pickled list of answers, as
``EngineServer`` does, either on the event loop's reader callback
(:class:`~memoryos_gpu.server.ipc.LoopSocket`, what the server uses) or through pyzmq's
``zmq.asyncio`` sockets (what it used before), on uvloop as the engine process runs (asyncio's
own loop without it). A blocking DEALER in this process keeps one
message in flight. Reported per side: the ROUTER process's CPU a message and round trips a
second, alternated ``--rounds`` times (medians), and asyncio's CPU a message over the loop
reader's.

    python benchmarks/ipc_channel.py --json benchmarks/results/ipc_channel.json
    python benchmarks/ipc_channel.py --quick
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import statistics
import tempfile
import time
from typing import Any

import zmq
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

SIDES = ("loop-reader", "zmq.asyncio")


def _answers(payload: bytes) -> bytes:
    return pickle.dumps([(r[0], True, b'{"pages": []}') for r in pickle.loads(payload)])


async def _loop_reader(address: str, ready: Any) -> None:
    from memoryos_gpu.server.ipc import LoopSocket  # imported before the clock (_serve)

    done = asyncio.get_running_loop().create_future()

    def answer(frames: list[bytes]) -> None:
        if frames[1] == b"stop":
            done.set_result(None)
        else:
            sock.send([frames[0], _answers(frames[1])])

    ctx = zmq.Context()
    sock = LoopSocket(ctx, zmq.ROUTER, answer)
    sock.sock.bind(address)
    sock.start()
    ready.set()
    await done
    sock.close()
    ctx.term()


async def _asyncio(address: str, ready: Any) -> None:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    while True:
        ident, payload = await sock.recv_multipart()
        if payload == b"stop":
            break
        sock.send_multipart([ident, _answers(payload)], flags=zmq.NOBLOCK)
    sock.close(0)
    ctx.term()


def _serve(side: str, address: str, ready: Any, out: Any) -> None:
    import zmq.asyncio  # noqa: F401 - imports are not the channel's cost

    import memoryos_gpu.server.ipc  # noqa: F401

    main = (_loop_reader if side == SIDES[0] else _asyncio)(address, ready)
    t0 = time.process_time()
    try:  # the engine process's loop (engine_process.serve_engine)
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)
    out.put(time.process_time() - t0)


def run_side(side: str, messages: int, per_msg: int, workdir: str) -> dict[str, float]:
    ctx_mp = mp.get_context("spawn")
    ready, out = ctx_mp.Event(), ctx_mp.Queue()
    address = f"ipc://{workdir}/{side}.sock"
    proc = ctx_mp.Process(target=_serve, args=(side, address, ready, out))
    proc.start()
    if not ready.wait(30):
        raise RuntimeError(f"{side}: the answering process did not start")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    request = [
        (i, "retrieve_body", ("user42", "what did I say about my dog", None, None))
        for i in range(per_msg)
    ]
    payload = pickle.dumps(request)
    t0 = time.perf_counter()
    for _ in range(messages):
        sock.send(payload)
        sock.recv()
    wall = time.perf_counter() - t0
    sock.send(b"stop")
    cpu = out.get(timeout=30)
    proc.join(30)
    sock.close(0)
    ctx.term()
    return {"cpu_us_per_message": cpu / messages * 1e6, "messages_per_s": messages / wall}


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--messages",
        type=positive_int,
        default=None,
        help="Messages each side sends per round (default 20000; --quick: 2000).",
    )
    ap.add_argument("--per-msg", type=positive_int, default=4, help="Requests a message carries.")
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="Alternated rounds per side, medians kept (default 3; --quick: 1).",
    )
    ap.add_argument("--quick", action="store_true", help="A small run for CI (seconds).")
    ap.add_argument("--json", default=None, help="Write the results here (JSON).")
    args = ap.parse_args(argv)
    check_output(ap, args.json)  # a bad output path fails now, not after the run
    apply_defaults(
        args, full={"messages": 20000, "rounds": 3}, quick={"messages": 2000, "rounds": 1}
    )
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                runs[side].append(run_side(side, args.messages, args.per_msg, workdir))
    med = {s: {k: statistics.median(x[k] for x in runs[s]) for k in runs[s][0]} for s in SIDES}
    ratio = med["zmq.asyncio"]["cpu_us_per_message"] / med["loop-reader"]["cpu_us_per_message"]
    print(f"{'side':12s} {'cpu us/msg':>10s} {'msgs/s':>8s}   ({args.per_msg} requests a message)")
    for s in SIDES:
        print(f"{s:12s} {med[s]['cpu_us_per_message']:10.1f} {med[s]['messages_per_s']:8.0f}")
    print(f"zmq.asyncio / loop-reader, CPU a message: {ratio:.2f}x")
    if args.json:
        result = {
            "benchmark": "ipc_channel",
            "date": today(),
            "hardware": machine_info(),
            "settings": vars(args),
            "runs": runs,
            "median": med,
            "asyncio_over_loop_reader_cpu": ratio,
        }
        write_json(args.json, result, indent=1)


if __name__ == "__main__":
    run_main(main)
