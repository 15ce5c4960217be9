"""The exceptions a service embedding the library catches, importable from ``memoryos_gpu``
itself (before, a handler mapping ``StoreLockedError`` to "another process holds the store"
or ``StoreFullError`` to 507 dug them out of ``memoryos_gpu.store.writer`` and friends), and
the error a closed engine answers with."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import memoryos_gpu
from memoryos_gpu import EngineClosedError, EngineConfig, MemoryEngine, MemoryOSError

#: Each exported exception and the module that defines it.
DEFINED_IN = {
    "EngineClosedError": "memoryos_gpu.errors",
    "EngineForkedError": "memoryos_gpu.errors",
    "LLMBackendError": "memoryos_gpu.llm.base",
    "LLMConfigError": "memoryos_gpu.llm.base",
    "StoreError": "memoryos_gpu.store.errors",
    "StoreFullError": "memoryos_gpu.store.errors",
    "StoreLockedError": "memoryos_gpu.store.writer",
    "StoreUnavailableError": "memoryos_gpu.store.errors",
}


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_each_exception_is_exported_as_the_class_the_library_raises(name: str) -> None:
    exported = getattr(memoryos_gpu, name)
    assert exported is getattr(importlib.import_module(DEFINED_IN[name]), name)
    assert issubclass(exported, MemoryOSError)
    assert name in memoryos_gpu.__all__


def test_the_store_errors_are_the_ones_the_store_package_exports() -> None:
    from memoryos_gpu import store

    for name in ("StoreError", "StoreFullError", "StoreLockedError", "StoreUnavailableError"):
        assert getattr(memoryos_gpu, name) is getattr(store, name)


def test_importing_the_package_stays_light_and_the_errors_import_first() -> None:
    """``import memoryos_gpu`` loads no submodule (``memoryos_gpu.ops`` on a bare GPU image
    needs only NumPy); each exception loads its own module when first named, with no cycle
    even as the very first import of a process."""
    probe = (
        "import sys, memoryos_gpu;"
        "print(sorted(m for m in sys.modules if m.startswith('memoryos_gpu')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['memoryos_gpu']"
    for name in sorted(DEFINED_IN):
        first = f"from memoryos_gpu import {name}; print({name}.__name__)"
        out = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == name, out.stderr


def test_a_locked_store_is_caught_by_its_exported_type(tmp_path: Path) -> None:
    cfg = EngineConfig(store=str(tmp_path / "s"), embedder="hashing", device="cpu")
    with MemoryEngine(cfg), pytest.raises(memoryos_gpu.StoreLockedError):
        MemoryEngine(cfg)


def test_a_closed_engine_refuses_a_retrieval_of_an_unknown_user_as_closed(
    tmp_path: Path,
) -> None:
    """After ``close``, ``retrieve("bob")`` raised UnknownUserError (the user check ran before
    the closed check): a handler mapping it to 404 answered 404 instead of 503."""
    engine = MemoryEngine(EngineConfig(store=str(tmp_path / "s"), embedder="hashing"))
    engine.add("alice", "alice likes tea")
    engine.close()
    for call in (
        lambda: engine.retrieve("bob", "tea"),
        lambda: engine.retrieve_many([("alice", "tea"), ("bob", "x")]),
        lambda: engine._retrieval.retrieve_many([("bob", "tea")]),
        lambda: engine.list_pages("bob"),
        lambda: engine.export_user("bob"),
    ):
        with pytest.raises(EngineClosedError, match="this MemoryEngine is closed"):
            call()
