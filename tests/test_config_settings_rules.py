"""How settings combine and what each accepts: presets, per-key overrides, the LLM URL and key
precedence, config.json's empty data path, bounds and strict TOML types (the new-user
configuration sweep, defects 3, 4, 5, 6, 9 and 11)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_runs import HASHING
from pydantic import ValidationError

from memoryos_gpu.cli.options import EngineOptions, UsageFailure, build_config
from memoryos_gpu.config import (
    EngineConfig,
    LLMConfig,
    MemoryConfig,
    explain_settings_error,
    preset,
)
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.reference import ConfigError, engine_config, settings


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in HASHING.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def _problems(exc: ValidationError) -> str:
    return explain_settings_error(exc, EngineConfig)


# ------------------------------------------------------------------ 5: presets
def test_naming_a_preset_gives_its_values() -> None:
    m = MemoryConfig(preset="reference")
    assert (m.stm_capacity, m.mtm_capacity, m.top_pages, m.eviction) == (10, 2000, 7, "lfu")
    assert MemoryConfig(preset="reference", top_pages=3).top_pages == 3
    assert MemoryConfig(preset="reference") == preset("reference")
    assert MemoryConfig(**preset("reference", top_pages=3).model_dump()).top_pages == 3


def test_an_unknown_preset_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError) as ei:
        EngineConfig(memory={"preset": "bogus"})
    assert "memory.preset" in _problems(ei.value)


def test_a_preset_named_twice_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="names two presets"):
        preset("paper", preset="reference")


# ------------------------------------------------------------------ 4: per-key overrides
def test_from_toml_overrides_merge_per_key(tmp_path: Path) -> None:
    path = _toml(
        tmp_path, '[memory]\npreset = "reference"\ntop_pages = 3\n[llm]\nmax_tokens = 99\n'
    )
    c = EngineConfig.from_toml(path, memory={"stm_capacity": 4}, llm={"mode": "llm"})
    assert (c.memory.preset, c.memory.top_pages, c.memory.stm_capacity) == ("reference", 3, 4)
    assert c.memory.mtm_capacity == 2000
    assert (c.llm.mode, c.llm.max_tokens) == ("llm", 99)


def test_from_toml_still_takes_a_model_and_a_key(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[memory]\ntop_pages = 3\n")
    c = EngineConfig.from_toml(path, memory=preset("reference"), encryption_key="k")
    assert c.memory.top_pages == 7 and c.encryption_key.get_secret_value() == "k"


# ------------------------------------------------------------------ 3: URL and key precedence
FILE_LLM = (
    '[llm]\nbackend = "openai"\nmodel = "m"\n'
    'options = {base_url = "http://file:1/v1", api_key = "file-key", timeout_s = 3}\n'
)


def test_the_flags_beat_the_files_options(tmp_path: Path) -> None:
    o = EngineOptions(
        store=":memory:",
        config=str(_toml(tmp_path, FILE_LLM)),
        llm_mode="llm",
        llm_base_url="http://flag:2/v1",
        llm_api_key="flag-key",
    )
    c = build_config(o)
    assert c.llm.base_url == "http://flag:2/v1" and c.llm.api_key == "flag-key"
    assert c.llm.options == {"timeout_s": 3}
    with MemoryEngine(c) as engine:
        assert engine.llm.base_url == "http://flag:2/v1"


def test_the_files_options_apply_without_flags(tmp_path: Path) -> None:
    o = EngineOptions(store=":memory:", config=str(_toml(tmp_path, FILE_LLM)), llm_mode="llm")
    with MemoryEngine(build_config(o)) as engine:
        assert engine.llm.base_url == "http://file:1/v1"


@pytest.mark.parametrize("key", ["base_url", "api_key", "model"])
def test_a_setting_given_twice_is_refused(key: str) -> None:
    value = "http://a:1/v1" if key == "base_url" else "x"
    with pytest.raises(ValidationError, match=f"{key} is given twice"):
        LLMConfig(**{key: value, "options": {key: value}})


def test_config_json_reads_an_option_in_place_of_its_key_and_refuses_both() -> None:
    s = settings({"openai_api_key": "k", "llm_options": {"base_url": "http://x:1/v1"}})
    assert engine_config(s, store=":memory:").llm.base_url == "http://x:1/v1"
    both = settings({"openai_base_url": "http://a:1/v1", "llm_options": {"base_url": "http://b"}})
    with pytest.raises(ConfigError, match=r"openai_base_url and llm_options\.base_url"):
        engine_config(both, store=":memory:")


# ------------------------------------------------------------------ 6: config.json's data path
def test_an_empty_data_storage_path_is_the_default() -> None:
    s = settings({"data_storage_path": ""})
    assert s.data_storage_path == "./memoryos_data"
    assert engine_config(s).store == "./memoryos_data"


# ------------------------------------------------------------------ 9: the embeddings URL
def test_the_embedding_url_needs_its_scheme() -> None:
    with pytest.raises(ValidationError) as ei:
        EngineConfig(embedding_base_url="localhost:9")
    assert "embedding_base_url must start with http://" in _problems(ei.value)
    assert EngineConfig(embedding_base_url="http://localhost:9/v1").embedding_base_url


# ------------------------------------------------------------------ 11: bounds
@pytest.mark.parametrize(
    ("table", "key", "value"),
    [
        ("memory", "query_keyword_weight", -5.0),
        ("memory", "theta", 100.0),
        ("memory", "theta", -100.0),
        ("memory", "continuity_threshold", 5.0),
        ("memory", "relevance_floor", 2.0),
        ("llm", "temperature", 1e9),
        ("llm", "max_tokens", 10**12),
    ],
)
def test_out_of_range_values_are_refused_naming_the_key(table: str, key: str, value: Any) -> None:
    with pytest.raises(ValidationError) as ei:
        EngineConfig(**{table: {key: value}})
    assert f"{table}.{key}" in _problems(ei.value)


def test_the_documented_extremes_are_accepted() -> None:
    m = preset("paper", lexical_weight=0.0, relevance_floor=-1.0, theta=-1.0)
    assert m.relevance_floor == -1.0
    assert LLMConfig(temperature=2.0, max_tokens=131_072).temperature == 2.0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[memory]\nstm_capacity = "7"\n', "memory.stm_capacity"),
        ('[memory]\nembed_dates = "yes"\n', "memory.embed_dates"),
        ('[llm]\nfused = "no"\n', "llm.fused"),
        ('store_cache_mb = "64"\n', "store_cache_mb"),
    ],
)
def test_toml_values_are_strictly_typed(tmp_path: Path, text: str, key: str) -> None:
    path = _toml(tmp_path, text)
    with pytest.raises(ValidationError) as ei:
        EngineConfig.from_toml(path)
    assert f"{key}:" in _problems(ei.value) and "(got str)" in _problems(ei.value)
    with pytest.raises(UsageFailure, match=key.replace(".", r"\.")):
        build_config(EngineOptions(store=":memory:", config=str(path)))


def test_a_toml_int_is_still_a_float(tmp_path: Path) -> None:
    c = EngineConfig.from_toml(_toml(tmp_path, "[memory]\ntau = 5\nmu_seconds = 86400\n"))
    assert c.memory.tau == 5.0


@pytest.mark.parametrize(("key", "table"), [("stm_capacity", "memory"), ("max_tokens", "llm")])
def test_a_table_key_at_the_top_level_says_where_it_belongs(
    tmp_path: Path, key: str, table: str
) -> None:
    with pytest.raises(ValidationError) as ei:
        EngineConfig.from_toml(_toml(tmp_path, f"{key} = 3\n"))
    assert f"it belongs in the [{table}] table" in _problems(ei.value)


def test_the_config_module_cites_no_missing_document() -> None:
    import memoryos_gpu.config as config

    assert "DESIGN.md" not in Path(config.__file__).read_text()
