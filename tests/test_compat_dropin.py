"""BAI-LAB MemoryOS code run against memoryos_gpu.compat: the messages and documented examples
a migration relies on (the findings of a migration test)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from memoryos_gpu import compat
from memoryos_gpu.compat import Memoryos
from memoryos_gpu.embed import HashingEmbedder
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.reference import ConfigError, load_config_json

DOC = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-memoryos.md"


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    compat.close_all()


@pytest.fixture
def hashing_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built without a ready embedder get the hashing one (no model to load)."""
    import memoryos_gpu.engine as engine_mod

    monkeypatch.setattr(engine_mod.MemoryEngine, "_make_embedder", lambda self: HashingEmbedder())


# ---------------------------------------------------------------------- finding 4
def test_get_response_with_llm_backend_none_names_that_setting(tmp_path: Path) -> None:
    memo = Memoryos(
        "alice",
        data_storage_path=str(tmp_path),
        openai_api_key="sk-abc",
        llm_backend="none",
        device="cpu",
        _embedder=HashingEmbedder(),
    )
    memo.add_memory("hi", "hello")
    with pytest.raises(MemoryOSError) as err:
        memo.get_response("hello?")
    assert "llm_backend='none' turns LLM calls off" in str(err.value)
    assert "no openai_api_key" not in str(err.value)


# ---------------------------------------------------------------------- finding 6
def test_a_negative_heat_threshold_is_refused_by_its_own_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mid_term_heat_threshold") as err:
        Memoryos("a", data_storage_path=str(tmp_path), mid_term_heat_threshold=-1.0)
    assert "tau" not in str(err.value)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"user_id": "a", "mid_term_heat_threshold": -1.0}))
    with pytest.raises(ConfigError, match="mid_term_heat_threshold") as err:
        load_config_json(config)
    assert "tau" not in str(err.value)


# ---------------------------------------------------------------------- finding 11
def _section_3_example() -> str:
    section = DOC.read_text(encoding="utf-8").split("## 3.", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashing_engines: None
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    scope: dict = {}
    # without credentials: LLM-free, so the last line raises the documented, clear error
    with pytest.raises(MemoryOSError, match="get_response needs an LLM"):
        exec(compile(_section_3_example(), str(DOC), "exec"), scope)
    assert scope["memo"].get_memory_stats()["short_term_count"] == 1


def test_the_documented_retrieve_context_call_is_the_codes() -> None:
    assert list(inspect.signature(Memoryos.retrieve_context).parameters) == ["self", "query"]
    assert "memo.retrieve_context(query)" in DOC.read_text(encoding="utf-8")
