"""The engine's size limits where they are set and where they are met: configured result counts
and arena widths bounded when the config is built (not at the first retrieval, where a huge one
aborted the process), text and ``meta`` measured as they are stored and said so, every page tier
in the store counts, and the HTTP API answering every size limit, ``meta``'s included, with 413
as docs/server.md says."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from memoryos_gpu import EngineConfig, MemoryEngine, preset
from memoryos_gpu.cli import cli
from memoryos_gpu.config import MemoryConfig
from memoryos_gpu.engine.validation import (
    MAX_COUNT,
    MAX_META_BYTES,
    MAX_TEXT_CHARS,
    InvalidInputError,
)

ROOT = Path(__file__).resolve().parents[1]
#: 11,000 CJK characters: 33,008 bytes of UTF-8 JSON, 66,008 ASCII-escaped
CJK_META = {"note": "\u4e2d" * 11_000}


def _engine(**memory: Any) -> MemoryEngine:
    return MemoryEngine(
        EngineConfig(store=":memory:", embedder="hashing", memory=preset("paper", **memory))
    )


def _refused_naming(field: str, build: Any) -> str:
    with pytest.raises(ValidationError) as info:
        build()
    text = str(info.value)
    assert field in text
    return text


# ========================================================= configured counts and widths
@pytest.mark.parametrize("field", ["top_segments", "top_pages", "knowledge_top_k"])
def test_a_configured_count_past_the_engines_limit_is_refused_when_built(field: str) -> None:
    """``top_segments = 1000000000`` built, then the first retrieval aborted the process (an
    uncaught std::bad_alloc) or raised MemoryError: it is refused now, naming the field."""
    text = _refused_naming(field, lambda: preset("paper", **{field: 1_000_000_000}))
    assert "10000" in text
    _refused_naming(field, lambda: MemoryConfig(**{field: MAX_COUNT + 1}))
    assert getattr(MemoryConfig(**{field: MAX_COUNT}), field) == MAX_COUNT


def test_the_largest_configured_count_retrieves() -> None:
    eng = _engine(top_segments=MAX_COUNT, top_pages=MAX_COUNT, knowledge_top_k=MAX_COUNT)
    try:
        eng.add("u", "I like green tea", "ok")
        assert eng.retrieve("u", "tea").stm
    finally:
        eng.close()


def test_keyword_width_is_bounded_and_named() -> None:
    """The arena reserves ``keyword_width`` ids per segment slot: 10,000,000 failed when the
    engine opened with a RuntimeError about address space that named no setting."""
    _refused_naming("keyword_width", lambda: MemoryConfig(keyword_width=10_000_000))
    _refused_naming("keyword_width", lambda: MemoryConfig(keyword_width=1_025))
    assert MemoryConfig(keyword_width=1_024).keyword_width == 1_024


def test_cpu_threads_past_any_machine_is_refused_naming_it() -> None:
    """2**40 threads failed when the engine opened, with a TypeError from the native call."""
    _refused_naming("cpu_threads", lambda: EngineConfig(embedder="hashing", cpu_threads=2**40))
    assert EngineConfig(embedder="hashing", cpu_threads=4_096).cpu_threads == 4_096


def test_capacities_stay_unbounded_but_the_knowledge_ring() -> None:
    """Capacities grow their arena rows by doubling as they fill: a large one is legitimate.
    Not the knowledge ring's: the engine maps each owner's ring positions to entry ids in a
    dense [owners, knowledge_capacity] int64 array made at open (10**7 took 1.3 GB for the
    first 16 owners, 10**12 failed at open asking for 116 TiB)."""
    m = MemoryConfig(stm_capacity=10**9, mtm_capacity=10**7, knowledge_capacity=65_536)
    assert (m.stm_capacity, m.mtm_capacity, m.knowledge_capacity) == (10**9, 10**7, 65_536)
    with pytest.raises(ValidationError, match="knowledge_capacity"):
        MemoryConfig(knowledge_capacity=65_537)


def test_cli_refuses_a_config_file_with_a_huge_top_segments(tmp_path: Path) -> None:
    store = tmp_path / "s"
    MemoryEngine(EngineConfig(store=str(store), embedder="hashing")).close()
    cfg = tmp_path / "big.toml"
    cfg.write_text('embedder = "hashing"\n[memory]\ntop_segments = 1000000000\n')
    args = ["retrieve", "--config", cfg, "--store", store, "--user", "c", "hi"]
    r = CliRunner().invoke(cli, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    assert "memory.top_segments" in r.output and "10000" in r.output


def test_reading_the_config_does_not_import_the_engine() -> None:
    """The limit is shared with the engine without config importing it (a CLI that only reads
    a config file stays light)."""
    code = "import sys, memoryos_gpu.config; print('memoryos_gpu.engine' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


# ====================================================================== text limit and NFC
def test_a_text_refused_after_nfc_says_so_with_both_lengths() -> None:
    """400,000 x U+FB2C is 1,200,000 code points in NFC: refused (the stored text would be over
    the limit), with a message that does not quote a length the caller never sent as its own."""
    eng = _engine()
    try:
        with pytest.raises(InvalidInputError) as info:
            eng.add("u", "\ufb2c" * 400_000, "ok")
        msg = str(info.value)
        assert "after Unicode NFC normalisation" in msg
        assert "1200000 characters" in msg and "400000 as sent" in msg
        assert eng.users() == []  # nothing stored
        with pytest.raises(InvalidInputError) as info:
            eng.add("u", "x" * (MAX_TEXT_CHARS + 1), "ok")
        assert str(info.value) == "user_input is 1000001 characters; the limit is 1000000"
    finally:
        eng.close()


# ================================================================== meta measured as stored
def test_meta_is_measured_as_the_utf8_json_the_store_keeps() -> None:
    """An 11,000-character CJK note is 33 KB as stored; counted ASCII-escaped (6 bytes a
    character) it was refused as 66,012 bytes."""
    eng = _engine()
    try:
        page_id = eng.add("u", "a note", "ok", meta=CJK_META).page_id
        assert CJK_META["note"] in json.dumps(eng.get_page(page_id), ensure_ascii=False)
        over = {"k": "\u4e2d" * ((MAX_META_BYTES - 8) // 3 + 1)}  # 65,537 bytes as stored
        with pytest.raises(InvalidInputError, match=r"meta is 65537 bytes as stored"):
            eng.add("u", "too much", "ok", meta=over)
    finally:
        eng.close()


# ==================================================================== every tier's count
def test_store_counts_name_every_tier_even_when_empty(backend: Any) -> None:
    """With every page in STM there was no ``pages_mtm`` key (a script got a KeyError); SQLite
    and PostgreSQL stores share the counts."""
    eng = MemoryEngine(EngineConfig(store=backend.spec("tiers"), embedder="hashing"))
    try:
        eng.add("u", "I like green tea", "ok")
        counts = eng.stats()["store"]
        assert {k: counts[k] for k in counts if k.startswith("pages_")} == {
            "pages_stm": 1,
            "pages_pending": 0,
            "pages_mtm": 0,
            "pages_evicted": 0,
        }
    finally:
        eng.close()


def test_cli_stats_lists_every_tier(tmp_path: Path) -> None:
    store = tmp_path / "s"
    eng = MemoryEngine(EngineConfig(store=str(store), embedder="hashing"))
    eng.add("u", "I like green tea", "ok")
    eng.close()
    r = CliRunner().invoke(cli, ["stats", "--store", str(store), "--json"])
    assert r.exit_code == 0, r.output
    counts = json.loads(r.output)["counts"]
    assert (counts["pages_stm"], counts["pages_mtm"], counts["pages_evicted"]) == (1, 0, 0)
    r = CliRunner().invoke(cli, ["stats", "--store", str(store)])
    assert "pages" in r.output and "mtm 0" in r.output and "stm 1" in r.output


# ============================================================================== HTTP API
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An open server (no keys) over a fresh store; skipped without the server extra."""
    for module in ("httpx", "uvicorn", "fastapi"):
        pytest.importorskip(module)
    from served import hashing, serve

    with serve(hashing(tmp_path_factory.mktemp("limits") / "s"), keys=None) as c:
        yield c


def _meta_of(n_bytes: int) -> dict[str, str]:
    """A meta of exactly ``n_bytes`` as stored (``{"k":"..."}`` is 8 bytes around the value)."""
    return {"k": "v" * (n_bytes - 8)}


@pytest.mark.parametrize("n_bytes", [MAX_META_BYTES + 1, 99_999, 100_001])
def test_http_meta_over_the_engines_limit_is_413_like_every_size_limit(
    server: Any, n_bytes: int
) -> None:
    """The engine's 65,536 applied after the server's 100,000 with a 422; now the server checks
    the lower of the two, and answers 413 ``too_large`` as for text and batches."""
    r = server.post("/v1/users/m/pages", json={"user_input": "m", "meta": _meta_of(n_bytes)})
    assert r.status_code == 413, r.text
    assert r.json()["error"] == "too_large"
    assert f"meta is {n_bytes} bytes" in r.text and str(MAX_META_BYTES) in r.text


def test_mem0_metadata_over_the_limit_is_413_as_a_pages_meta(server: Any) -> None:
    """mem0's ``metadata`` becomes the pages' meta: it skipped the server's check and got the
    engine's 422."""
    body = {"messages": [{"role": "user", "content": "hi"}], "user_id": "m0"}
    r = server.post("/v1/mem0/memories", json={**body, "metadata": _meta_of(MAX_META_BYTES + 1)})
    assert r.status_code == 413, r.text
    assert r.json()["error"] == "too_large"
    r = server.post("/v1/mem0/memories", json={**body, "metadata": {"k": "v"}})
    assert r.status_code in (200, 201), r.text


def test_http_meta_at_the_limit_and_non_latin_meta_are_stored(server: Any) -> None:
    for meta in (_meta_of(MAX_META_BYTES), CJK_META):
        r = server.post("/v1/users/m2/pages", json={"user_input": "m", "meta": meta})
        assert r.status_code == 201, r.text


def test_http_top_pages_limit_is_the_documented_one(server: Any) -> None:
    r = server.post("/v1/users/h/retrieve", json={"query": "q", "top_pages": 101})
    assert r.status_code == 422 and "100" in r.text


# ==================================================================================== docs
def _docs(name: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / "docs" / name).read_text())


def test_docs_give_the_limits_the_code_applies() -> None:
    from memoryos_gpu.server.models import RetrieveIn

    server_md, storage_md = _docs("server.md"), _docs("storage.md")
    le = {
        name: next(m.le for m in RetrieveIn.model_fields[name].metadata if hasattr(m, "le"))
        for name in ("top_pages", "top_segments")
    }
    assert f"`top_pages` (1 to {le['top_pages']} per request)" in server_md
    assert f"`top_segments` (1 to {le['top_segments']})" in server_md
    assert f"{MAX_META_BYTES:,}" in server_md and "`meta` as JSON (same limit)" not in server_md
    assert f"at most {MAX_META_BYTES:,} bytes" in storage_md
    assert "after NFC" in storage_md
