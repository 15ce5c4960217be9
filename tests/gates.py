"""Threads a test holds at a known point: a scripted LLM stage that blocks until released,
and a call run in the background whose result or exception the test collects. Shared by the
concurrency tests (``test_derived_concurrency.py``, ``test_sharded_concurrency.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from memoryos_gpu.llm.base import ChatRequest

GATE_TIMEOUT = 10.0  # how long a gated stage waits for the test; every wait below is shorter


class GatedScript:
    """A scripted responder whose ``stage`` requests block while the gate is armed.

    ``entered`` is set when such a request arrives; the request then waits until ``release``
    is set (or ``GATE_TIMEOUT`` passes) before answering like ``script``."""

    def __init__(self, script: Callable[[ChatRequest], Any], stage: str) -> None:
        self.script = script
        self.stage = stage
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()  # unarmed until arm()

    def arm(self) -> None:
        self.entered.clear()
        self.release.clear()

    def __call__(self, req: ChatRequest) -> Any:
        if req.stage == self.stage and not self.release.is_set():
            self.entered.set()
            self.release.wait(GATE_TIMEOUT)
        return self.script(req)


class Background(threading.Thread):
    """Runs ``fn`` in a thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # kept for finish() to raise in the test's thread
            self.error = exc

    def finish(self) -> Any:
        self.join(GATE_TIMEOUT * 2)
        assert not self.is_alive(), "the background call did not finish"
        if self.error is not None:
            raise self.error
        return self.result
