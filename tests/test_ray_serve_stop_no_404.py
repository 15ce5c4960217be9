"""``serve --ray`` never answers 404 while it stops: the router's 503, then connection refused.

Why: ``ray_serve.run`` deleted the application (``serve.delete``) while Serve's HTTP proxy kept
listening until Ray stopped, and the proxy answered ``404 Path '/v1/users/…' not found``
(text/plain) for every request meanwhile: about 3.7 s, 528 answers in a sweep under load, which
clients take for "no such route" and do not retry. Now a run that started Serve shuts Serve
down whole (``serve.shutdown``: the controller stops the proxies in the step that starts
deleting the applications); Serve that was running before, or that holds other applications,
keeps its proxies and only this application is deleted.

A fake ``ray.serve`` (no Ray started): it models what a client gets, from the proxy's state,
after every call :func:`run` makes to it. A real run: ``tests/test_ray_serve_shutdown.py``.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

import pytest

from memoryos_gpu.config import EngineConfig
from memoryos_gpu.distributed import ray_serve


class FakeServe:
    """What a client of ``/v1/users/u/pages`` gets from Serve, as the calls go: ``refused``
    (no proxy listens), ``503`` (the router refuses, once its ``finish`` began), ``200``, or
    ``404`` (the proxy listens, and no application routes the path)."""

    def __init__(
        self, running: bool = False, other_apps: tuple[str, ...] = (), deployed_meanwhile: str = ""
    ) -> None:
        self.proxy = running or bool(other_apps)
        self.apps: dict[str, str] = {name: "/other" for name in other_apps}
        self.deployed_meanwhile = deployed_meanwhile  # another's application, while serving
        self.finishing = False
        self.calls: list[str] = []
        self.answers: list[tuple[str, str]] = []

    def answer(self) -> str:
        if not self.proxy:
            return "refused"
        if "/" not in self.apps.values():
            return "404"
        return "503" if self.finishing else "200"

    def _did(self, call: str) -> None:
        self.calls.append(call)
        self.answers.append((call, self.answer()))

    # the ray.serve API run() uses
    def status(self) -> Any:
        proxies = {"node": "HEALTHY"} if self.proxy else {}
        return SimpleNamespace(proxies=proxies, applications=dict.fromkeys(self.apps, "RUNNING"))

    def start(self, http_options: dict[str, Any]) -> None:
        self.proxy = True
        self._did("start")

    def run(self, app: Any, name: str, route_prefix: str) -> None:
        self.apps[name] = route_prefix
        if self.deployed_meanwhile:
            self.apps[self.deployed_meanwhile] = "/theirs"
        self._did("run")
        signal.raise_signal(signal.SIGTERM)  # the stop, once serving (run's handler takes it)

    def get_app_handle(self, name: str) -> Any:
        def finish() -> Any:
            self.finishing = True
            self._did("finish")
            return SimpleNamespace(result=lambda: {"keyword_docs": 0, "assistant_facts": 0})

        return SimpleNamespace(finish=SimpleNamespace(remote=finish))

    def delete(self, name: str) -> None:  # Serve's proxy stays: it serves until Ray stops
        self.apps.pop(name, None)
        self._did("delete")

    def shutdown(self) -> None:  # the proxies stop as the applications are deleted
        self.proxy = False
        self.apps.clear()
        self._did("shutdown")


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``ray_serve.run`` over a :class:`FakeServe`, nothing of Ray or of a store touched."""
    for name in ("check_layout", "check_shard_writers", "ensure_ray"):
        monkeypatch.setattr(ray_serve, name, lambda *a, **k: None)
    monkeypatch.setattr(ray_serve, "build_app", lambda *a, **k: object())

    def go(serve: FakeServe) -> FakeServe:
        monkeypatch.setattr(ray_serve, "_serve", lambda: serve)
        before = signal.getsignal(signal.SIGTERM)
        ray_serve.run(EngineConfig(store="unused", embedder="hashing", device="cpu"), 2)
        assert signal.getsignal(signal.SIGTERM) == before  # run() restored it
        return serve

    return go


def test_serve_it_started_stops_with_its_proxy_never_404(fake_run: Any) -> None:
    """The stop the sweep met (``serve --ray``, its own Serve): 503 during the shards' end,
    then nothing listens; the application and Serve go in one step (was: ``delete``, then 404
    until Ray stopped)."""
    serve = fake_run(FakeServe())
    # "404" right after start is Serve's proxy before any application is routed, as before
    assert [a for _, a in serve.answers[1:]] == ["200", "503", "refused"], serve.answers
    assert serve.calls == ["start", "run", "finish", "shutdown"], serve.calls


@pytest.mark.parametrize(
    "serve",
    [
        FakeServe(running=True),
        FakeServe(other_apps=("theirs",)),
        FakeServe(deployed_meanwhile="theirs"),
    ],
    ids=["serve-was-running", "other-applications", "deployed-meanwhile"],
)
def test_serve_not_its_own_keeps_the_proxy(fake_run: Any, serve: FakeServe) -> None:
    """Serve that was running before, or that serves other applications (from the start or
    since): only this application is deleted; the proxies and the others' applications stay
    (their paths under this application's answer Serve's 404 then: it is not this run's to
    stop)."""
    others = set(serve.apps) | ({serve.deployed_meanwhile} - {""})
    fake_run(serve)
    assert serve.calls == ["start", "run", "finish", "delete"], serve.calls
    assert serve.proxy
    assert set(serve.apps) == others
