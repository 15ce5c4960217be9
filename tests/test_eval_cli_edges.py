"""Edges of the measuring tools found by a user's sweep: `eval`, `bench`, `retrieve`,
`profile` and the benchmark scripts taking a LoCoMo `--data` file.

A wrong or empty `--data` must be a one-line refusal before the run (it was a traceback or a
table of NaN reported as success); page budgets above the engine's limit a usage error at
parse time (it was an engine error about `top_pages` after the ingestion); `retrieve --json`
must write a page as the text output does; `eval` must say what it measured (embedder, preset,
device) and what it could not score; `bench` must not take options it ignores; extractive
mode must explain an empty profile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from memoryos_gpu import cli as cli_mod
from memoryos_gpu.cli.output import page_json, print_retrieval
from memoryos_gpu.engine.validation import MAX_COUNT

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
LOCOMO_MINI = Path(__file__).parent / "data" / "locomo_mini.json"
SAMPLE = ROOT / "memoryos_gpu" / "data" / "sample_chats.jsonl"
EXTRACTIVE_HINT = "profiles are written by the LLM stages"


@pytest.fixture(autouse=True)
def _hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMORYOS_GPU_EMBEDDER", "hashing")
    monkeypatch.delenv("MEMORYOS_GPU_STORE", raising=False)


def run_cli(*args: Any) -> Any:
    return CliRunner().invoke(cli_mod.cli, [str(a) for a in args])


def run_script(name: str, *args: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "MEMORYOS_GPU_EMBEDDER": "hashing"}
    return subprocess.run(
        [sys.executable, str(BENCH / name), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def locomo_with_questions(tmp_path: Path, qa: list[dict[str, Any]]) -> Path:
    """locomo_mini's first conversation with these questions instead of its own."""
    conv = json.loads(LOCOMO_MINI.read_text())[0]
    conv["qa"] = qa
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([conv]))
    return path


# ------------------------------------------------------------------ 1, 2: benchmark --data
LOCOMO_SCRIPTS = [
    "locomo.py",
    "embedders.py",
    "retrieval_path.py",
    "throughput.py",
    "llm_batching.py",
]


@pytest.mark.parametrize("script", LOCOMO_SCRIPTS)
def test_a_data_file_that_is_not_locomo_is_a_one_line_refusal(script: str) -> None:
    p = run_script(script, "--quick", "--data", SAMPLE)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "error: not a LoCoMo file:" in p.stderr and "speaker_a" in p.stderr


@pytest.mark.parametrize("script", LOCOMO_SCRIPTS)
def test_a_data_file_with_nothing_to_run_on_is_refused(script: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    out = tmp_path / "report.json"
    p = run_script(script, "--quick", "--data", empty, "--json", out)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "nan" not in p.stdout
    assert re.search(r"error: .*empty\.json has no question", p.stderr), p.stderr
    assert not out.exists()  # no report of a run that did not happen


@pytest.mark.parametrize("script", ["locomo.py", "embedders.py"])
def test_the_scoring_scripts_refuse_a_file_without_scorable_questions(
    script: str, tmp_path: Path
) -> None:
    """Questions there are, but none of categories 1-4 with evidence: recall is undefined."""
    data = locomo_with_questions(
        tmp_path,
        [
            {"question": "Who is Nora's cat?", "evidence": ["D1:1"], "category": 5},
            {"question": "Would Nora like camping?", "evidence": [], "category": 3},
        ],
    )
    p = run_script(script, "--quick", "--data", data)
    assert p.returncode == 2, p.stderr
    assert "categories 1-4 with evidence: nothing to score" in p.stderr


# ------------------------------------------------------------------ 3: page-count bounds
def test_eval_k_above_the_engine_limit_is_refused_when_parsed(tmp_path: Path) -> None:
    res = run_cli("eval", "--k", MAX_COUNT + 1, LOCOMO_MINI)
    assert res.exit_code == 2, res.output
    assert "'--k'" in res.output and f"1<=x<={MAX_COUNT}" in res.output
    assert f"{MAX_COUNT}" in run_cli("eval", "--help").output


@pytest.mark.parametrize("option", ["--top-pages", "--top-segments"])
def test_retrieve_counts_above_the_engine_limit_are_usage_errors(
    option: str, tmp_path: Path
) -> None:
    # refused when parsed: before the store is looked for (there is none here)
    res = run_cli("retrieve", "--store", tmp_path / "none", "--user", "u", option, 20000, "q")
    assert res.exit_code == 2, res.output
    assert f"'{option}'" in res.output and f"1<=x<={MAX_COUNT}" in res.output
    assert f"x<={MAX_COUNT}" in run_cli("retrieve", "--help").output


# ------------------------------------------------------------------ 4: retrieve --json text
def _page(user_input: str, agent_response: str, extra: dict[str, Any]) -> Any:
    return SimpleNamespace(
        page_id=1,
        user_input=user_input,
        agent_response=agent_response,
        timestamp=1.7e9,
        score=0.5,
        tier="mtm",
        meta="",
        extra=extra,
    )


def _retrieval(*pages: Any, profile: dict[str, str] | None = None) -> Any:
    return SimpleNamespace(
        user_id="conv-1",
        query="q",
        retrieval_tokens=10,
        profile=profile or {},
        pages=list(pages),
        stm=[],
        user_knowledge=[],
        assistant_knowledge=[],
        all_pages=lambda: list(pages),
    )


def test_retrieve_json_text_names_the_speakers_as_the_text_output_does(capsys: Any) -> None:
    names = {"speaker_a": "Caroline", "speaker_b": "Melanie"}
    only_b = _page("", "Hey Caroline, since we last chatted", names)
    both = _page("I went to a group", "Sounds great", names)
    plain = _page("hello", "hi there", {})
    assert page_json(only_b)["text"] == "Melanie: Hey Caroline, since we last chatted"
    assert page_json(both)["text"] == "Caroline: I went to a group\nMelanie: Sounds great"
    assert page_json(plain)["text"] == "User: hello\nAssistant: hi there"
    print_retrieval(_retrieval(only_b, both))
    shown = [line.strip() for line in capsys.readouterr().out.splitlines()]
    for p in (only_b, both):  # every line of the JSON text is a line of the text output
        for line in page_json(p)["text"].splitlines():
            assert line in shown


def test_retrieve_json_of_a_locomo_store_uses_the_speakers(tmp_path: Path) -> None:
    store = tmp_path / "lc"
    assert run_cli("ingest", LOCOMO_MINI, "--store", store).exit_code in (0, 3)  # 3: rejects
    res = run_cli("retrieve", "--store", store, "--user", "conv-a", "--no-heat", "--json", "Nora")
    assert res.exit_code == 0, res.output
    pages = json.loads(res.stdout)["pages"]
    assert pages
    for p in pages:
        assert not p["text"].startswith("User:") and "Assistant:" not in p["text"]
        assert all(line.split(": ", 1)[1] for line in p["text"].splitlines())  # no empty side


# ------------------------------------------------------------------ 5: embedders' ratio line
def _embedders_module() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import embedders
    finally:
        sys.path.remove(str(BENCH))
    return embedders


@pytest.mark.parametrize(
    ("torch_ms", "onnx_ms", "words"),
    [(37.8, 22.9, "1.65x less CPU per page"), (20.0, 40.0, "2.00x more CPU per page")],
)
def test_embedders_says_which_way_the_cpu_ratio_goes(
    torch_ms: float, onnx_ms: float, words: str, capsys: Any
) -> None:
    embedders = _embedders_module()
    rows = [
        {
            "backend": name,
            "pages": 80,
            "pages_per_s": pps,
            "cpu_ms_per_page": ms,
            "load_s": 1.0,
            "recall": {"5": 0.5},
        }
        for name, pps, ms in (("torch-fp32", 25.2, torch_ms), ("onnx-int8", 40.8, onnx_ms))
    ]
    embedders.print_table({"results": rows, "comparison": embedders.compare(rows, (5,))})
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("onnx-int8 / torch-fp32:") and words in line


# ------------------------------------------------------------------ 6, 7, 10: eval's report
def test_eval_reports_unmatched_and_malformed_evidence(tmp_path: Path) -> None:
    data = locomo_with_questions(
        tmp_path,
        [
            {"question": "Where did Nora hike?", "evidence": ["D99:1"], "category": 1},
            {"question": "What did Nora do?", "evidence": ["D1:2"], "category": 1},
            {"question": "q3", "evidence": ["garbage"], "category": 2},
        ],
    )
    res = run_cli("eval", data, "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["questions"] == 2
    assert got["evidence_ids_unmatched"] == 1
    assert got["evidence_ids_malformed"] == 1
    assert got["questions_not_scored"] == 1
    text = run_cli("eval", data).stdout
    assert "1 id naming no turn (each counted as a miss)" in text
    assert "1 malformed id (ignored" in text
    assert "1 question without evidence not scored" in text


def test_eval_names_what_produced_the_numbers(tmp_path: Path) -> None:
    res = run_cli("eval", "--quick", "--json", "--preset", "reference", LOCOMO_MINI)
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["embedder"].startswith("hashing-")
    assert got["preset"] == "reference" and got["device"] == "cpu"
    text = run_cli("eval", "--quick", LOCOMO_MINI).stdout
    assert re.search(r"embedder hashing-\S+, preset paper, device cpu", text), text


def test_eval_counts_are_singular_for_one(tmp_path: Path) -> None:
    data = locomo_with_questions(
        tmp_path, [{"question": "Where did Nora hike?", "evidence": ["D1:2"], "category": 4}]
    )
    first = run_cli("eval", data).stdout.splitlines()[0]
    assert first.startswith("1 conversation, ") and "1 question (" in first


def test_eval_quick_help_says_unevidenced_questions_are_not_scored() -> None:
    help_text = " ".join(run_cli("eval", "--help").output.split())
    assert "first 40 questions (those without evidence are not scored" in help_text


def test_instructions_quick_help_matches_the_readme() -> None:
    readme = (BENCH / "README.md").read_text()
    said = re.search(r"`instructions\.py` \(callgrind, (~\d+ min)\)", readme)
    assert said, "benchmarks/README.md no longer states instructions.py's quick duration"
    p = run_script("instructions.py", "--help")
    assert p.returncode == 0, p.stderr
    assert said.group(1) in " ".join(p.stdout.split())


# ------------------------------------------------------------------ 8: bench's options
def test_bench_takes_only_the_options_it_uses() -> None:
    help_text = run_cli("bench", "--help").output
    assert "--device" in help_text
    for unused in ("--store", "--preset", "--embedder", "--llm-mode", "--config"):
        assert unused not in help_text
    res = run_cli("bench", "--users", "5", "--repeat", "1", "--preset", "reference")
    assert res.exit_code == 2, res.output  # said as before the subcommand, not "No such option"
    assert "bench builds no engine and does not use --preset" in res.output
    # given before the subcommand (the group takes every engine option): refused too
    res = run_cli("--embedder", "openai", "bench", "--users", "5", "--repeat", "1")
    assert res.exit_code == 2, res.output
    assert "bench builds no engine and does not use --embedder" in res.output


def test_bench_device_works_before_or_after_the_subcommand() -> None:
    small = ["--users", "5", "--slots", "4", "--repeat", "1", "--json"]
    for args in (["bench", "--device", "cpu", *small], ["--device", "cpu", "bench", *small]):
        res = run_cli(*args)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["device"] == "cpu"


# ------------------------------------------------------------------ 9: the empty profile
def test_extractive_mode_explains_the_empty_profile(tmp_path: Path) -> None:
    src = tmp_path / "maya.jsonl"
    src.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:6]))
    store = tmp_path / "st"
    assert run_cli("ingest", src, "--store", store).exit_code == 0
    res = run_cli("profile", "--store", store, "--user", "maya_chen")
    assert res.exit_code == 0, res.output
    assert f"profile: (none: {EXTRACTIVE_HINT}" in res.stdout and "--llm-mode llm" in res.stdout
    res = run_cli("retrieve", "--store", store, "--user", "maya_chen", "--no-heat", "marathon")
    assert res.exit_code == 0, res.output
    assert EXTRACTIVE_HINT in res.stdout


def test_a_profile_is_shown_and_not_explained_away(capsys: Any) -> None:
    print_retrieval(_retrieval(profile={"city": "Lisbon"}), extractive=True)
    out = capsys.readouterr().out
    assert "city: Lisbon" in out and EXTRACTIVE_HINT not in out
