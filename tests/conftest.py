"""Shared fixtures of the engine tests: a table-driven embedder, a scripted LLM responder and an
engine factory. Everything here is deterministic and model-free."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from memoryos_gpu.config import EngineConfig, LLMConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.llm.base import ChatRequest
from memoryos_gpu.llm.scripted import ScriptedBackend

# The CPU kernels run OpenMP parallel regions even on tiny inputs. With the default (active,
# spinning) wait policy each call costs a scheduler quantum (~15 ms instead of ~0.05 ms)
# whenever the 2-core box is busy with other processes; the engine tests make thousands of
# such calls. Set before the OpenMP runtime loads: importing the engine does not load
# memoryos_gpu._C (nor torch); the first kernel call does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray Serve kills an HTTP proxy that has not answered its readiness check within 5 s, three
# times in a row (~17 s); on a loaded 2-core box the proxy process took longer than that to
# start, and every serve.start() failed with ActorDiedError ("killed by ray.kill"). Ray's
# processes and the tests' `serve --ray` subprocesses inherit this.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")


class TableEmbedder:
    """Texts in ``table`` get the given vector (zero-padded to ``dim``, NOT normalised, so a
    test controls cosines exactly); any other text a seeded pseudo-random unit vector (random
    vectors in 256 dimensions are nearly orthogonal: |cos| < 0.35 in practice)."""

    def __init__(self, dim: int = 256, table: Mapping[str, Sequence[float]] | None = None):
        self._dim = dim
        self.table: dict[str, Sequence[float]] = dict(table or {})
        self.seen: list[str] = []

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def model_id(self) -> str:
        return f"table-{self._dim}"

    def vector(self, text: str) -> np.ndarray:
        if text in self.table:
            v = np.zeros(self._dim, np.float32)
            given = np.asarray(self.table[text], np.float32)
            v[: given.size] = given
            return v
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        v = np.random.default_rng(seed).standard_normal(self._dim)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        self.seen.extend(texts)
        if not texts:
            return np.zeros((0, self._dim), np.float32)
        return np.stack([self.vector(t) for t in texts])


_CURRENT_USER = re.compile(r"CURRENT page:\nTime: [^\n]*\nUser: (.*?)\nAssistant:", re.DOTALL)


def current_user_input(req: ChatRequest) -> str:
    """The user text of the page a "page" / "continuity" / ... request is about."""
    content = req.messages[-1]["content"]
    m = _CURRENT_USER.search(content)
    if m:
        return m.group(1)
    found = re.findall(r"\nUser: (.*?)\nAssistant:", "\n" + content, re.DOTALL)
    return found[-1] if found else ""


class Script:
    """Scripted LLM answers keyed by a page's user input.

    ``pages[user_input]`` overrides fields of the fused "page" answer (default: not continuous,
    meta ``"meta <ui>"``, summary ``"sum <ui>"``, no keywords, so the Jaccard term is 0 unless
    a test sets keywords); a ``str`` value is
    returned verbatim (e.g. invalid JSON). ``promotion`` is a callable or a fixed answer.
    """

    def __init__(
        self,
        pages: Mapping[str, Any] | None = None,
        promotion: Any = None,
        response: str = "scripted reply",
    ) -> None:
        self.pages = dict(pages or {})
        self.promotion = promotion
        self.response = response

    def page_answer(self, ui: str) -> Any:
        spec = self.pages.get(ui, {})
        if isinstance(spec, str):
            return spec
        return {
            "continuous": False,
            "meta": f"meta {ui}",
            "summary": f"sum {ui}",
            "keywords": [],
            **spec,
        }

    def __call__(self, req: ChatRequest) -> Any:
        if req.stage == "page":
            return self.page_answer(current_user_input(req))
        if req.stage == "promotion":
            p = self.promotion
            out = p(req) if callable(p) else p
            return out or {"profile_updates": {}, "user_facts": [], "assistant_facts": []}
        if req.stage == "response":
            return self.response
        raise AssertionError(f"unexpected stage {req.stage!r} in a fused-mode test")


EngineFactory = Callable[..., MemoryEngine]


#: The arena the engine tests run on: "cpu", or "cuda" (the GPU's, float16 embeddings).
TEST_DEVICE = os.environ.get("MEMORYOS_TEST_DEVICE", "cpu")


def score_tol(cpu: float) -> float:
    """A score tolerance on the test arena: ``cpu`` on the CPU's float32 embeddings. The GPU
    stores them in float16 (11 significant bits), which moves a cosine by up to ~5e-4 and a
    standardised score by ~2e-3 (an H200 measured 1.6e-4 and 1.0e-3)."""
    return cpu if TEST_DEVICE == "cpu" else max(cpu, 2e-3)


def pipe(data: bytes) -> tuple[str, int, threading.Thread]:
    """A pipe fed ``data`` by a thread, as a shell's ``<(zcat x.gz)`` gives one: ``(its
    /dev/fd path, its read descriptor, the feeder)``. Close the descriptor once read, and the
    next pipe gets the same number, as the shell's do."""
    r, w = os.pipe()

    def feed() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(data)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return f"/dev/fd/{r}", r, t


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Any]:
    """One local Ray for a test module (2 CPUs, no dashboard, workers' logs not echoed):
    started unless one runs, shut down after the module; skips without Ray."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'memoryos-gpu[ray]'")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def chain_engine(store: str, pages: int) -> MemoryEngine:
    """An engine whose every page after the first continues the chain (the scripted LLM says
    so, ``p0`` .. ``p{pages-1}``), each with a new meta; STM holds one page, so every add
    sends the previous one towards MTM; derived work waits for ``process_pending``."""
    script = {f"p{i}": {"continuous": i > 0, "meta": f"meta {i}"} for i in range(pages)}
    cfg = EngineConfig(
        memory=preset("paper", stm_capacity=1),
        llm=LLMConfig(mode="llm", backend="scripted"),
        embedder="hashing",
        device="cpu",
        store=store,
        auto_process=False,
    )
    return MemoryEngine(cfg, embedder=TableEmbedder(), llm=ScriptedBackend(Script(pages=script)))


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers above, as a fixture: ``from conftest import`` is ambiguous because
    tests/llm has a conftest.py of its own."""
    return SimpleNamespace(
        TableEmbedder=TableEmbedder,
        Script=Script,
        current_user_input=current_user_input,
        device=TEST_DEVICE,
        score_tol=score_tol,
        pipe=pipe,
        chain_engine=chain_engine,
    )


@pytest.fixture
def make_engine() -> Any:
    """``make_engine(mode="llm", script=None, embedder=None, store=":memory:", clock=...,
    preset="paper", **memory_overrides)`` -> MemoryEngine on the CPU arena (or on
    ``$MEMORYOS_TEST_DEVICE``)."""
    made: list[MemoryEngine] = []

    def make(
        *,
        mode: str = "llm",
        script: Any = None,
        embedder: Any = None,
        store: str = ":memory:",
        fused: bool = True,
        **memory: Any,
    ) -> MemoryEngine:
        mem = preset(memory.pop("preset", "paper"), **memory)
        cfg = EngineConfig(
            memory=mem,
            llm=LLMConfig(mode=mode, backend="scripted", fused=fused),
            embedder="hashing",
            device=TEST_DEVICE,
            store=store,
        )
        llm = ScriptedBackend(script if script is not None else Script()) if mode == "llm" else None
        eng = MemoryEngine(cfg, embedder=embedder or TableEmbedder(), llm=llm)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        with contextlib.suppress(Exception):  # already closed by the test
            eng.close()


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Each store backend in turn (``store_backends.make_backend``; PostgreSQL skips without a
    server), cleaned up after."""
    from store_backends import make_backend

    b = make_backend(request.param, tmp_path)
    try:
        yield b
    finally:
        b.cleanup()
