"""Edges of the LLM backends: odd 200 answers, a server that goes away, the overall request
deadline, the transformers backend's prompt budget, misconfiguration, degenerate JSON output."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent / "llm"))

from fake_openai_server import FakeServer, ok_body

from memoryos_gpu import prompts
from memoryos_gpu.config import EngineConfig, LLMConfig
from memoryos_gpu.errors import MemoryOSError
from memoryos_gpu.llm import (
    ChatRequest,
    LLMBackendError,
    LLMConfigError,
    OpenAICompatBackend,
    make_backend,
)
from memoryos_gpu.llm.jsonfix import parse_json_output

SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string"}},
    "required": ["topic"],
}
PAGE = {
    "user_input": "I am Maya. I run marathons and I live in Seattle.",
    "agent_response": "Nice.",
    "timestamp": 1_700_000_000,
}


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def backend(url: str, **kw: Any) -> OpenAICompatBackend:
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    kw.setdefault("timeout_s", 5)
    return OpenAICompatBackend(url, "test-model", **kw)


def req(text: str, schema: dict | None = SCHEMA, **kw: Any) -> ChatRequest:
    return ChatRequest(messages=({"role": "user", "content": text},), json_schema=schema, **kw)


def _answer(content: Any, usage: Any = None) -> dict:
    body: dict[str, Any] = {"choices": [{"message": {"role": "assistant", "content": content}}]}
    if usage is not None:
        body["usage"] = usage
    return body


# ------------------------------------------------------------------ 1. odd 200 answers


MALFORMED = {
    "list body": [1, 2],
    "empty list body": [],
    "null body": None,
    "content int": _answer(123),
    "content dict": _answer({"text": "x"}),
    "content parts not dicts": _answer(["x"]),
    "message string": {"choices": [{"message": "hello"}]},
    "no message": {"choices": [{"text": "legacy completion"}]},
    "choices dict": {"choices": {"0": 1}},
    "choices empty": {"choices": [], "usage": {}},
}


@pytest.mark.parametrize("body", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_answer_fails_only_its_request(server: FakeServer, body: Any) -> None:
    good = ok_body('{"topic": "tea"}', 7, 3)
    server.script = lambda n, b: (200, {}, body if "BAD" in str(b) else good, 0)
    with backend(server.url) as b:
        res = b.generate([req("ok1"), req("BAD"), req("ok2")])
    assert [r.parsed for r in (res[0], res[2])] == [{"topic": "tea"}] * 2
    assert res[1].error is not None and res[1].error.startswith("malformed response")
    assert res[1].text == "" and res[1].parsed is None


@pytest.mark.parametrize(
    "usage",
    [
        "lots",
        {"prompt_tokens": "abc", "completion_tokens": [1]},
        '{"prompt_tokens": NaN, "completion_tokens": Infinity}',
        '{"prompt_tokens": 1e999, "completion_tokens": -1e999}',
        {"prompt_tokens": -5, "completion_tokens": True},
        {"prompt_tokens": 2.5, "completion_tokens": None},
    ],
)
def test_odd_usage_counts_as_zero_and_keeps_the_answer(server: FakeServer, usage: Any) -> None:
    if isinstance(usage, str) and usage.startswith("{"):  # not JSON-encodable: sent raw
        payload: Any = (
            '{"choices": [{"message": {"content": "{\\"topic\\": \\"t\\"}"}}], "usage": '
            + usage
            + "}"
        )
    else:
        payload = _answer('{"topic": "t"}', usage)
    server.script = lambda n, b: (200, {}, payload, 0)
    with backend(server.url) as b:
        (r,) = b.generate([req("x")])
        assert b.stats.prompt_tokens == 0 and b.stats.completion_tokens == 0
    assert r.error is None and r.parsed == {"topic": "t"}
    assert (r.prompt_tokens, r.completion_tokens) == (0, 0)


def test_integral_float_usage_counts(server: FakeServer) -> None:
    usage = {"prompt_tokens": 12.0, "completion_tokens": 4}
    server.script = lambda n, b: (200, {}, _answer('{"topic": "t"}', usage), 0)
    with backend(server.url) as b:
        (r,) = b.generate([req("x")])
    assert (r.prompt_tokens, r.completion_tokens) == (12, 4)


def test_content_parts_are_joined(server: FakeServer) -> None:
    parts = [
        {"type": "text", "text": '{"topic": '},
        {"type": "refusal", "refusal": "ignored"},
        {"type": "text", "text": '"tea"}'},
    ]
    server.script = lambda n, b: (200, {}, _answer(parts, {"prompt_tokens": 3}), 0)
    with backend(server.url) as b:
        (r,) = b.generate([req("x")])
    assert r.error is None and r.text == '{"topic": "tea"}' and r.parsed == {"topic": "tea"}
    assert r.prompt_tokens == 3


def test_null_content_is_an_empty_answer(server: FakeServer) -> None:
    server.script = lambda n, b: (200, {}, _answer(None), 0)
    with backend(server.url) as b:
        (r,) = b.generate([req("x", schema=None)])
    assert r.error is None and r.text == ""


@pytest.mark.parametrize("raw", ["[" * 100_000, "<html><body>502 Bad Gateway</body></html>"])
def test_a_non_json_200_fails_its_request_and_a_batch_of_them_is_an_outage(
    server: FakeServer, raw: str
) -> None:
    """A body that is not JSON (nested too deep, an HTML error page) is the server's failure,
    not the model's answer: alone in a batch of good answers it is that request's error, but a
    batch whose every request got one (a web UI or a proxy's error page at base_url) raised
    nothing, and every page of it was stored with its fallback for good."""
    good = ok_body('{"topic": "tea"}')
    server.script = lambda n, b: (200, {}, raw if "BAD" in str(b) else good, 0)
    with backend(server.url, max_retries=0) as b:
        res = b.generate([req("ok"), req("BAD")])
        assert res[0].parsed == {"topic": "tea"}
        assert res[1].error is not None and "non-JSON" in res[1].error
        with pytest.raises(LLMBackendError, match="failed"):
            b.generate([req("BAD 1"), req("BAD 2")])


# ------------------------------------------------------------------ 2. a server that goes away


def test_server_down_after_first_contact_raises(server: FakeServer) -> None:
    """Refused connections after the retries fail the batch (the caller keeps the work
    pending) even once the server has answered: it did not fail one request, it went away."""
    # no keep-alive: a server that stops takes its connections with it
    server.script = lambda n, b: (200, {"Connection": "close"}, ok_body('{"topic": "t"}'), 0)
    b = backend(server.url, max_retries=1)
    try:
        assert b.generate([req("x")])[0].parsed == {"topic": "t"}
        server.close()
        with pytest.raises(LLMBackendError, match=r"cannot connect.*answered earlier"):
            b.generate([req("x"), req("y")])
        assert b.stats.retries >= 1  # retried before giving up
    finally:
        b.close()
        server.close = lambda: None  # the fixture's close: already closed


def test_per_request_problems_after_contact_stay_per_request(server: FakeServer) -> None:
    def script(n: int, body: dict) -> tuple:
        text = str(body["messages"])
        if "BAD" in text:
            return 400, {}, {"error": {"message": "no"}}, 0
        if "ODD" in text:
            return 200, {}, [], 0
        return 200, {}, ok_body('{"topic": "t"}'), 0

    server.script = script
    with backend(server.url) as b:
        b.generate([req("x")])
        res = b.generate([req("BAD"), req("ODD"), req("ok")])
    assert res[0].error == "HTTP 400: no"
    assert res[1].error is not None and res[1].error.startswith("malformed")
    assert res[2].parsed == {"topic": "t"}


# ------------------------------------------------------------------ 5. the overall deadline


class _TricklingServer:
    """Answers every request with headers at once, then its body one byte every ``every``
    seconds: each read is quick, the whole answer is not."""

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        body = b'{"choices": [{"message": {"content": "' + b"x" * 200 + b'"}}]}'
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
                for i in range(len(body)):
                    if self.stop.wait(self.every):
                        return
                    conn.sendall(body[i : i + 1])
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_timeout_bounds_the_whole_request() -> None:
    """httpx's timeout is per read; a trickling server must still be cut at ``timeout_s``
    (the old behaviour took ~200 reads x 0.1 s = 20 s per attempt)."""
    trickle = _TricklingServer(every=0.1)
    try:
        with backend(trickle.url, timeout_s=0.5, max_retries=1) as b:
            t0 = time.monotonic()
            with pytest.raises(LLMBackendError) as info:  # its batch's only request: an outage
                b.generate([req("x", schema=None)])
            elapsed = time.monotonic() - t0
    finally:
        trickle.close()
    error = str(info.value)
    assert "timeout after 0.5s" in error
    assert "gave up after 1 retries" in error and trickle.requests == 2  # a timeout: retried
    assert elapsed < 4.0


# ------------------------------------------------------------------ 3. the transformers budget


class _CharTokenizer:
    """One token per character: a prompt's length in tokens is its length in characters."""

    chat_template = None
    padding_side = "right"
    pad_token_id = 0
    eos_token_id = 0
    eos_token = "\0"
    model_max_length = int(1e30)  # transformers' "no limit known"

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


class _FakeModel:
    def __init__(self, context: int) -> None:
        self.config = SimpleNamespace(max_position_embeddings=context)
        self.generation_config = SimpleNamespace(eos_token_id=0)

    def to(self, device: str) -> _FakeModel:
        return self

    def eval(self) -> _FakeModel:
        return self


def _fake_transformers_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, context: int, **kw: Any
) -> Any:
    transformers = pytest.importorskip("transformers")
    from memoryos_gpu.llm.transformers_backend import TransformersBackend

    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _CharTokenizer()
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _FakeModel(context)
    )
    return TransformersBackend(
        model=str(tmp_path), device="cpu", dtype="float32", constrained="none", **kw
    )


def test_the_default_budget_is_the_models_context(monkeypatch, tmp_path) -> None:
    b = _fake_transformers_backend(monkeypatch, tmp_path, context=32_768)
    msgs, schema = prompts.fused_promotion({}, [PAGE])
    promo = ChatRequest(msgs, schema, max_tokens=256, stage="promotion")
    assert b.max_input_tokens is None and b.context_tokens == 32_768
    assert b.input_limit(promo) == 32_768 - 256
    ids = b.prompt_ids(promo)  # the old fixed 2048 refused every fused promotion
    assert len(ids) > 2048 and b.tokenizer.decode(ids).endswith("assistant: ")

    b.context_tokens = 1000  # the prompt and the answer share the window
    long = ChatRequest(({"role": "user", "content": "w " * 5000 + "QUESTION"},), max_tokens=100)
    ids = b.prompt_ids(long)
    assert len(ids) <= 900 and "QUESTION" in b.tokenizer.decode(ids)
    with pytest.raises(ValueError, match="1000-token context less max_tokens=256"):
        b.prompt_ids(promo)


def test_an_explicit_budget_still_wins(monkeypatch, tmp_path) -> None:
    b = _fake_transformers_backend(monkeypatch, tmp_path, context=32_768, max_input_tokens=300)
    long = ChatRequest(({"role": "user", "content": "w " * 5000 + "QUESTION"},), max_tokens=100)
    assert b.input_limit(long) == 300 and len(b.prompt_ids(long)) <= 300
    with pytest.raises(LLMConfigError, match="max_input_tokens"):
        make_backend("transformers", max_input_tokens=0)


def test_context_length_sources() -> None:
    from memoryos_gpu.llm.transformers_backend import context_length

    no_limit = SimpleNamespace(model_max_length=int(1e30))
    assert context_length(SimpleNamespace(max_position_embeddings=8192), no_limit) == 8192
    assert context_length(SimpleNamespace(n_positions=1024), no_limit) == 1024
    multimodal = SimpleNamespace(get_text_config=lambda: SimpleNamespace(seq_length=4096))
    assert context_length(multimodal, no_limit) == 4096
    assert context_length(SimpleNamespace(), SimpleNamespace(model_max_length=512)) == 512
    assert context_length(SimpleNamespace(), no_limit) == 2048


@pytest.mark.slow
def test_bundled_smollm2_takes_a_fused_promotion() -> None:
    """The documented default (bundled SmolLM2, context 8192): a promotion for one short page
    (~2,200 tokens of prompt) is not refused by the prompt budget (~18 s on 2 cores)."""
    try:
        from memoryos_gpu.llm.transformers_backend import (
            TransformersBackend,
            bundled_smollm2_path,
        )

        bundled_smollm2_path()
    except (ImportError, LLMBackendError) as e:
        pytest.skip(f"the bundled SmolLM2 is unavailable: {e}")
    msgs, schema = prompts.fused_promotion({}, [PAGE])
    promo = ChatRequest(msgs, schema, max_tokens=256, stage="promotion")
    with TransformersBackend(device="cpu") as b:
        assert b.context_tokens == 8192
        assert 2048 < len(b.prompt_ids(promo)) <= 8192 - 256


# ------------------------------------------------------------------ 4. misconfiguration


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"backend": "nonsense"}, "unknown LLM backend 'nonsense'"),
        ({"base_url": "127.0.0.1:8000"}, "must start with http:// or https://"),
    ],
)
def test_llm_settings_are_checked_in_the_config(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LLMConfig(**settings)


def test_llm_settings_that_are_fine() -> None:
    assert LLMConfig(backend="HF").backend == "transformers"  # aliases: one spelling
    assert LLMConfig(backend="openai").base_url is None  # extractive: nothing required
    c = LLMConfig(mode="llm", backend="openai", options={"base_url": "http://h", "model": "m"})
    assert c.backend == "openai"


SERVER = {"base_url": "http://127.0.0.1:9", "model": "m"}


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("nonsense", {}, "unknown LLM backend kind 'nonsense'"),
        ("openai", {**SERVER, "bogus": 1}, "the openai backend has no option 'bogus'"),
        ("openai", {**SERVER, "max_retries": -1}, "the openai backend refused .*max_retries"),
        ("openai", {**SERVER, "timeout_s": 0}, "the openai backend refused .*timeout_s"),
        # a config file's string where a number goes: named, not "'>' not supported between"
        ("openai", {**SERVER, "timeout_s": "3"}, "timeout_s must be a number, got '3'"),
        ("openai", {**SERVER, "max_retries": "2"}, "max_retries must be a number, got '2'"),
        ("openai", {**SERVER, "max_concurrency": True}, "max_concurrency must be a number"),
        ("openai", {**SERVER, "base_url": "h:1"}, "the openai backend refused .*http://"),
        ("openai", {"model": "m"}, "the openai backend needs the option 'base_url'"),
        ("vllm", {}, "the vllm backend needs the option 'model'"),
        ("scripted", {}, "the scripted backend needs the option 'responder'"),
    ],
)
def test_backend_options_fail_as_configuration_errors(
    kind: str, options: dict, message: str
) -> None:
    with pytest.raises(LLMConfigError, match=message) as ei:
        make_backend(kind, **options)
    assert isinstance(ei.value, MemoryOSError) and isinstance(ei.value, ValueError)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {
                "backend": "openai",
                "base_url": "http://127.0.0.1:9",
                "model": "m",
                "options": {"x": 1},
            },
            "the openai backend has no option 'x'",
        ),
        (
            {"backend": "openai", "model": "m"},
            "--llm-base-url / [llm] base_url is required for the openai backend",
        ),
        (
            {"backend": "openai", "base_url": "http://127.0.0.1:9"},
            "--llm-model / [llm] model is required for the openai backend",
        ),
        ({"backend": "vllm"}, "--llm-model / [llm] model is required for the vllm backend"),
    ],
)
def test_engine_reports_llm_misconfiguration(tmp_path: Path, settings: dict, message: str) -> None:
    from memoryos_gpu.engine import MemoryEngine

    llm = LLMConfig(mode="llm", **settings)
    cfg = EngineConfig(llm=llm, embedder="hashing", store=str(tmp_path / "s.db"))
    with pytest.raises(LLMConfigError) as ei:
        MemoryEngine(cfg)
    assert message in str(ei.value)


@pytest.mark.parametrize(
    ("llm", "code", "message"),
    [
        (
            'options = {bogus = 1}\nmodel = "m"\nbase_url = "http://127.0.0.1:9"',
            2,  # a setting's error: refused before the store is opened or created
            "invalid engine configuration: the openai backend has no option 'bogus'",
        ),
        ('model = "m"', 2, "--llm-base-url / [llm] base_url is required"),
        ('model = "m"\nbase_url = "127.0.0.1:9"', 2, "must start with http://"),
    ],
)
def test_cli_reports_llm_misconfiguration_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture, llm: str, code: int, message: str
) -> None:
    from memoryos_gpu.cli.app import main

    config = tmp_path / "c.toml"
    config.write_text(f'[llm]\nmode = "llm"\nbackend = "openai"\n{llm}\n')
    pages = Path(__file__).parent / "data" / "pages.jsonl"
    argv = ["ingest", str(pages), "--store", str(tmp_path / "s"), "--config", str(config)]
    assert main([*argv, "--embedder", "hashing"]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("model", ["missing.gguf", "missing-folder"])
def test_cli_refuses_a_transformers_model_path_that_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture, model: str
) -> None:
    # a setting's error (exit 2, as a missing embedding model), before the store is created:
    # it was exit 1, and a missing folder read as transformers' complaint about repo ids
    from memoryos_gpu.cli.app import main

    pytest.importorskip("transformers")
    pages = Path(__file__).parent / "data" / "pages.jsonl"
    store = tmp_path / "s"
    llm = ["--llm-mode", "llm", "--llm-backend", "transformers"]
    argv = ["ingest", str(pages), "--store", str(store), "--embedder", "hashing", *llm]
    assert main([*argv, "--llm-model", str(tmp_path / model)]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and str(tmp_path / model) in err and "Traceback" not in err
    assert not store.exists()


# ------------------------------------------------------------------ 6. degenerate JSON output


@pytest.mark.parametrize("text", ["{" * 20_000, "[" * 20_000, '{"a": [' * 5_000])
def test_degenerate_output_is_cheap(text: str) -> None:
    _, schema = prompts.fused_page(None, None, PAGE)
    t0 = time.monotonic()
    assert parse_json_output(text, schema) == (None, False)
    assert time.monotonic() - t0 < 1.0  # was ~1 ms per '{': 20,000 took 22 s


def test_deep_but_valid_json_still_parses_and_shallow_json_is_still_repaired() -> None:
    deep = "[" * 40 + "1" + "]" * 40
    value, repaired = parse_json_output(deep)
    assert not repaired and value is not None
    assert parse_json_output('Sure: {"topic": "tea",}', SCHEMA) == ({"topic": "tea"}, True)
    assert parse_json_output('{"topic": "a \\" {{{{ [[[[ quote"', SCHEMA)[0] == {
        "topic": 'a " {{{{ [[[[ quote'
    }
