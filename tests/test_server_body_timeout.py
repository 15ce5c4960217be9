"""The HTTP server bounds how long a request's body may take to arrive (``body_timeout_s``).

A client that sent its headers and then stalled its upload (or trickled it a byte at a time)
used to hold a connection and a request forever, and a shutdown for the whole graceful timeout,
then got a plain-text 500. Now, ``body_timeout_s`` after the request arrived, it gets ``408
{"error": "body_timeout"}`` and the connection is closed; nothing of the request is stored, the
log has one line, and a shutdown waits for no such client past the timeout. A slow but steady
upload inside the timeout is served as before.

Every test serves on a real uvicorn server and speaks raw HTTP over a socket (an HTTP client
library sends a body whole).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from click.testing import CliRunner  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from served import HA, KEY_A, KEYS, ROOT, free_port, hashing, serve  # noqa: E402

from memoryos_gpu.cli import cli  # noqa: E402
from memoryos_gpu.server.app import create_app  # noqa: E402
from memoryos_gpu.server.settings import ServerSettings  # noqa: E402

TIMEOUT = 1.0  # the servers' body_timeout_s here
PAGE = json.dumps({"user_input": "I keep bees", "agent_response": "nice"}).encode()
BATCH = json.dumps({"pages": [{"user_id": "u1", "user_input": "I keep bees"}]}).encode()


@pytest.fixture(params=[True, False], ids=["direct", "fastapi"])
def direct_routes(request: pytest.FixtureRequest) -> bool:
    """The single-page route is served by the edge itself or by FastAPI: both must agree."""
    return request.param


def _port(client: Any) -> int:
    return int(str(client.base_url).rsplit(":", 1)[1])


def _head(path: str, length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\n{size}\r\n\r\n"
    ).encode()


def _answer(s: socket.socket, wait: float = 10.0) -> tuple[int, dict[str, str], bytes, bool]:
    """The response on ``s`` (status, headers, body) and whether the server then closed the
    connection (read to EOF, ``wait`` seconds at most)."""
    s.settimeout(wait)
    data = b""
    closed = False
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            closed = True
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            if "content-length" in headers and len(body) >= int(headers["content-length"]):
                deadline = min(deadline, time.monotonic() + 1.0)  # whole: is it closed?
                s.settimeout(max(0.01, deadline - time.monotonic()))
    assert data, "no answer"
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body, closed


def _stalled(port: int, path: str, length: int | None = 100) -> tuple[int, dict, Any, bool, float]:
    """Send ``path``'s headers and 10 bytes of its body, then nothing: the answer (status,
    headers, JSON body, closed) and the seconds it took."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.monotonic()
        part = b'{"user_inp'
        s.sendall(_head(path, length) + (part if length is not None else b"a\r\n" + part))
        status, headers, body, closed = _answer(s)
        return status, headers, json.loads(body), closed, time.monotonic() - t0


def _trickled(port: int, path: str, body: bytes, gap: float) -> tuple[int, Any, float]:
    """Send ``body`` a few bytes every ``gap`` seconds until it is whole or answered."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.monotonic()
        s.sendall(_head(path, len(body)))
        step = max(1, len(body) // 5)
        for i in range(0, len(body), step):
            if select.select([s], [], [], gap)[0]:
                break  # answered before the body was whole
            try:
                s.sendall(body[i : i + step])
            except OSError:  # the server closed the connection
                break
        status, _headers, answer, _closed = _answer(s)
        return status, json.loads(answer), time.monotonic() - t0


def _users(c: Any) -> list[str]:
    r = c.get("/v1/users", headers=HA)
    assert r.status_code == 200, r.text
    users: list[str] = r.json()["users"]
    return users


# ====================================================================== a stalled upload
@pytest.mark.parametrize("path", ["/v1/users/u1/pages", "/v1/pages", "/v1/mem0/memories"])
def test_a_stalled_upload_is_a_408_and_nothing_is_stored(
    direct_routes: bool, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="memoryos_gpu.server"),
        serve(
            hashing(), direct_routes=direct_routes, body_timeout_s=TIMEOUT, metrics_public=True
        ) as c,
    ):
        status, headers, body, closed, took = _stalled(_port(c), path)
        assert status == 408, body
        assert body["error"] == "body_timeout", body
        assert "did not arrive within 1 s (10 of 100 bytes received)" in body["detail"]
        assert "nothing of the request was stored" in body["detail"]
        assert headers["content-type"] == "application/json"
        assert headers.get("connection") == "close" and closed  # the rest is never read
        assert TIMEOUT * 0.9 <= took < TIMEOUT + 4, took
        assert _users(c) == []  # nothing of it stored
        # the server goes on serving
        assert (
            c.post("/v1/users/u2/pages", json={"user_input": "hi"}, headers=HA).status_code == 201
        )
        assert _users(c) == ["u2"]
        metrics = c.get("/metrics").text
        assert 'memoryos_rejected_total{reason="body_timeout"} 1.0' in metrics
    said = [r for r in caplog.records if "did not arrive within" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].levelno == logging.INFO and f"POST {path} from 127.0.0.1" in said[0].getMessage()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage()) for r in errors]


def test_a_stalled_chunked_upload_is_a_408_too(direct_routes: bool) -> None:
    """A body without Content-Length (counted, and charged to the key, as it is read)."""
    with serve(hashing(), direct_routes=direct_routes, body_timeout_s=TIMEOUT) as c:
        for path in ("/v1/users/u1/pages", "/v1/pages"):
            status, _headers, body, closed, _took = _stalled(_port(c), path, length=None)
            assert status == 408 and body["error"] == "body_timeout", body
            assert "(10 bytes received)" in body["detail"] and closed
        assert _users(c) == []


# ====================================================================== slow clients
def test_a_trickled_body_past_the_timeout_is_a_408(direct_routes: bool) -> None:
    """The whole body is bounded, not the gap between two chunks: a client that keeps sending
    a little at a time cannot hold a request open past the timeout either."""
    with serve(hashing(), direct_routes=direct_routes, body_timeout_s=TIMEOUT) as c:
        body = b" " * 200 + PAGE  # 6 parts, 0.4 s apart: 2 s in all
        status, answer, took = _trickled(_port(c), "/v1/users/u1/pages", body, gap=0.4)
        assert status == 408 and answer["error"] == "body_timeout", answer
        assert took < TIMEOUT + 4, took
        assert _users(c) == []


def test_a_slow_but_steady_upload_inside_the_timeout_is_served(direct_routes: bool) -> None:
    with serve(hashing(), direct_routes=direct_routes, body_timeout_s=3.0) as c:
        # 6 parts, 0.1 s apart: 0.5 s in all, each gap and the whole well inside 3 s
        status, answer, _took = _trickled(_port(c), "/v1/users/u1/pages", PAGE, gap=0.1)
        assert status == 201, answer
        status, answer, _took = _trickled(_port(c), "/v1/pages", BATCH, gap=0.1)
        assert status == 201, answer
        assert _users(c) == ["u1"]
        pages = c.get("/v1/users/u1/pages", headers=HA).json()
        assert pages["total"] == 2, pages


# ====================================================================== shutdown
def test_a_stalled_upload_does_not_hold_a_shutdown() -> None:
    """SIGTERM (here: uvicorn's should_exit) with a stalled upload in flight: the client gets
    its 408 at the body timeout and the shutdown goes on; before, it waited the whole graceful
    timeout (10 s here, 30 s in ``run``) and the client got a plain-text 500."""
    app = create_app(
        hashing(),
        api_keys=KEYS,
        settings=ServerSettings(body_timeout_s=TIMEOUT),
        use_env_keys=False,
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=10,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(_head("/v1/users/u1/pages", 100) + b'{"user_inp')
            time.sleep(0.2)  # the request is in flight
            t0 = time.monotonic()
            server.should_exit = True
            status, _headers, body, closed = _answer(s, wait=15)
            assert status == 408 and json.loads(body)["error"] == "body_timeout", body
            assert closed
        thread.join(15)
        took = time.monotonic() - t0
        assert not thread.is_alive()
        assert took < TIMEOUT + 4, f"the shutdown took {took:.1f} s"
    finally:
        server.should_exit = True
        thread.join(30)


RUN = """
import json, sys
from memoryos_gpu.server.app import run
run(**json.loads(sys.argv[1]))
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_run_answers_408_and_a_sigterm_is_not_held(tmp_path: Path, workers: int) -> None:
    """``run`` (what ``memoryos-gpu serve`` runs), in one process and with a worker process in
    front of the engine process (the setting travels to it): a stalled upload is a 408, and a
    SIGTERM with one in flight exits 0 at the body timeout, not at the graceful timeout (20 s
    here)."""
    port = free_port()
    spec = {
        "store": str(tmp_path / "store"),
        "port": port,
        "embedder": "hashing",
        "api_keys": KEYS,
        "workers": workers,
        "graceful_timeout_s": 20,
        "body_timeout_s": TIMEOUT,
    }
    env = {k: v for k, v in os.environ.items() if k != "MEMORYOS_GPU_API_KEYS"}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", RUN, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if _answer(s, wait=5)[0] == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        status, _headers, body, closed, took = _stalled(port, "/v1/users/u1/pages")
        assert status == 408 and body["error"] == "body_timeout" and closed, body
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(_head("/v1/users/u1/pages", 100) + b'{"user_inp')
            time.sleep(0.3)  # the request is in flight
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status, _headers, answer, _closed = _answer(s, wait=15)
            assert status == 408 and json.loads(answer)["error"] == "body_timeout", answer
        assert proc.wait(15) == 0, log.read_text()[-3000:]
        took = time.monotonic() - t0
        assert took < TIMEOUT + 8, f"the shutdown took {took:.1f} s"
        text = log.read_text()
        assert text.count("the request body did not arrive within 1 s") == 2, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ====================================================================== the setting
def test_the_setting_defaults_to_30_s_and_is_bounded() -> None:
    assert ServerSettings().body_timeout_s == 30.0
    assert ServerSettings(body_timeout_s=3600).body_timeout_s == 3600
    for bad in (0, -1, 3601, float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="body_timeout_s"):
            ServerSettings(body_timeout_s=bad)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The apps ``uvicorn.run`` was given, instead of serving them (``--workers 0``), and the
    workers' supervisor's arguments (``--workers N``)."""
    import memoryos_gpu.server.workers as workers_module

    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_API_KEYS", raising=False)
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.setattr(workers_module, "run_workers", lambda *a, **kw: apps.append(a))
    return apps


def _serve(tmp_path: Path, table: str, workers: str = "0") -> Any:
    cfg = tmp_path / "memoryos.toml"
    cfg.write_text(f"[server]\n{table}\n")
    argv = ["serve", "--store", str(tmp_path / "store"), "--embedder", "hashing"]
    argv += ["--port", str(free_port()), "--config", str(cfg), "--workers", workers]
    return CliRunner().invoke(cli, argv), cfg


def test_serve_reads_the_setting_from_the_server_table(tmp_path: Path, served: list[Any]) -> None:
    res, _cfg = _serve(tmp_path, "body_timeout_s = 5")
    assert res.exit_code == 0, res.output
    (app,) = served
    assert app.state.settings.body_timeout_s == 5.0


@pytest.mark.parametrize("value", ["0", "-1", "3601", "inf", "nan", '"soon"'])
@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_bad_body_timeout_is_refused_naming_it(
    tmp_path: Path, served: list[Any], value: str, workers: str
) -> None:
    res, cfg = _serve(tmp_path, f"body_timeout_s = {value}", workers)
    assert res.exit_code == 2, res.output
    assert f"invalid [server] settings in {cfg}" in res.output and "body_timeout_s" in res.output
    assert served == [] and not (tmp_path / "store").exists()


def test_the_api_description_names_the_408_on_operations_with_a_body() -> None:
    with serve(hashing()) as c:
        spec = c.get("/openapi.json").json()
    for path, item in spec["paths"].items():
        for method, op in item.items():
            body = "requestBody" in op
            assert ("408" in op["responses"]) == body, (method, path)
            if body:
                assert "body_timeout_s" in op["responses"]["408"]["description"]
