"""Drop-in facade with the method names of the reference ``memoryos`` package (BAI-LAB/MemoryOS).

Code written against the reference switches by changing one import::

    # from memoryos import Memoryos
    from memoryos_gpu.compat import Memoryos

    memo = Memoryos(user_id="alice", openai_api_key=KEY, data_storage_path="./mem")
    memo.add_memory("I adopted a cat named Miso.", "Congratulations!")
    print(memo.get_response("What is my cat called?"))

Differences a user should know (docs/migrating-from-memoryos.md walks through them):

* Every ``Memoryos`` with the same ``data_storage_path`` shares one
  :class:`~memoryos_gpu.engine.MemoryEngine` (one SQLite file, ``memory.sqlite3`` in that folder:
  the file the MCP server and ``--store`` use for that folder), so many users are batched
  together. The memory settings (capacities, thresholds) belong to that shared engine: opening
  the same folder with different settings raises ``ValueError``. One process writes a store at a
  time: run the MCP server and a script on one folder one after the other, or in one process
  (``MemoryService(memo.engine)`` under :func:`memoryos_gpu.server.mcp_server.build_mcp`).
* Defaults are the reference's (``short_term_capacity=10``, ``mid_term_capacity=2000``,
  ``retrieval_queue_capacity=7``, the ``reference`` preset); ``preset="paper"`` selects the
  paper's mechanics instead.
* The LLM: ``llm_backend=`` names any backend (``"openai"``, ``"vllm"``, ``"transformers"``,
  ``"none"``) or is a ready :class:`~memoryos_gpu.llm.base.LLMBackend`; ``llm_options`` are its
  constructor's options. By default an ``openai_api_key`` and/or ``openai_base_url`` (any
  OpenAI-compatible server: vLLM, llama.cpp, Ollama; no key needed for a local one) selects
  ``"openai"``; without either, memory runs LLM-free ("extractive" mode: embedding continuity,
  keyword summaries, first-person facts) and :meth:`get_response` raises
  :class:`~memoryos_gpu.errors.MemoryOSError` explaining how to configure an LLM. As in the
  reference, a failing LLM makes :meth:`get_response` return ``"Error: Could not get response
  from LLM."`` (the exchange is not remembered) and never makes :meth:`add_memory` raise (the
  page is stored; its derived work is retried by the next call). An answer is bounded by the
  engine's ``llm.max_tokens`` (256 by default, not the reference's 1500): one longer than those
  tokens can hold is such a failure too, as the HTTP ``respond`` route refuses it.
* Timestamps print as given: a naive one is local time (as the reference's clock is), the
  default is now; see :mod:`memoryos_gpu.reference`. Epoch seconds and ISO-8601 are accepted too;
  one that does not parse raises :class:`~memoryos_gpu.engine.InvalidInputError` (a
  ``ValueError``). ``meta_data`` is kept with the page (the reference ignores it), so it must be
  a dict (a JSON object) or None: anything else raises that error too, naming ``meta_data``.
* ``assistant_id`` left out is the reference's ``"default_assistant_profile"`` for a new user,
  and the user's stored assistant for one the folder holds (filed under another assistant by
  the MCP server, the HTTP API or the mem0 API, say); an ``assistant_id`` given explicitly
  must be that user's (``ValueError`` otherwise: a user keeps one assistant).
* The reference's JSON files are not read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from memoryos_gpu import prompts
from memoryos_gpu.config import EngineConfig, MemoryConfig
from memoryos_gpu.engine import InvalidInputError, MemoryEngine
from memoryos_gpu.engine.responses import too_long
from memoryos_gpu.errors import EngineClosedError, MemoryOSError, UnknownUserError
from memoryos_gpu.llm.base import LLMBackendError
from memoryos_gpu.profile_dims import render_profile
from memoryos_gpu.reference import (
    DEFAULT_ASSISTANT_ID,
    LLM_ERROR_TEXT,
    engine_config,
    page_stamp,
    read_timestamp,
    settings,
    stamp,
    user_meta,
)
from memoryos_gpu.types import PageInput

__all__ = ["Memoryos", "close_all"]

log = logging.getLogger("memoryos_gpu.compat")
LEGACY_STORE_FILE = "memoryos.sqlite"  # this facade's file before it shared the MCP server's

_LLM_HOW = (
    "Pass openai_api_key=... (OpenAI) and/or openai_base_url='http://host:port/v1' (any "
    "OpenAI-compatible server: vLLM, llama.cpp, Ollama) with llm_model='<served model name>'; "
    "or llm_backend='vllm' | 'transformers' (llm_options=... for its options). Memory itself "
    "(add_memory, retrieve_context, profile and knowledge extraction) works without an LLM."
)


def _llm_help(llm_backend: str | None) -> str:
    """Why get_response has no LLM: an explicit ``llm_backend='none'`` (or ``'extractive'``)
    turns it off whatever credentials are given, so naming missing credentials would send
    the caller looking for the wrong cause."""
    if llm_backend is not None:
        why = f"llm_backend={llm_backend!r} turns LLM calls off (keys and URLs are then unused)"
        return f"get_response needs an LLM, and {why}. Leave llm_backend out or: {_LLM_HOW}"
    return (
        "get_response needs an LLM, and this Memoryos runs LLM-free (no openai_api_key, "
        f"openai_base_url or llm_backend was given). {_LLM_HOW}"
    )


class _DefaultAssistant(str):
    """The type of ``Memoryos``'s ``assistant_id`` default: the reference's text (so the
    signature and ``help()`` show ``'default_assistant_profile'``), told apart by identity from
    the same text passed explicitly. Left out, the facade takes the user's stored assistant
    (a user the mem0 API filed under ``'default'`` opens with the defaults); named, it must be
    the user's."""

    __slots__ = ()


_DEFAULT_ASSISTANT = _DefaultAssistant(DEFAULT_ASSISTANT_ID)


# one engine per storage folder: {abs path: [engine, open facades]}
_ENGINES: dict[str, list[Any]] = {}
_ENGINES_LOCK = threading.Lock()


def close_all() -> None:
    """Close every shared engine (tests; interpreter shutdown closes SQLite anyway)."""
    with _ENGINES_LOCK:
        for engine, _ in _ENGINES.values():
            engine.close()
        _ENGINES.clear()


class Memoryos:
    """One user's memory with the reference implementation's API, on a shared batch engine.

    Parameters follow the reference's ``Memoryos.__init__`` in the same positional order, with
    its defaults; ``embedding_model_name`` ``None`` / ``""`` / ``"all-MiniLM-L6-v2"`` selects the
    bundled MiniLM, any other value is a local model folder or a Hugging Face id already in the
    local cache (nothing is downloaded). Extra keywords: ``llm_backend``, ``llm_options`` (see
    the module docstring), ``preset`` (``"reference"`` or ``"paper"``), ``device`` (``"auto"``,
    ``"cpu"``, ``"cuda"``), ``memory`` (further :class:`~memoryos_gpu.config.MemoryConfig`
    overrides), and for tests ``_engine_config`` (a full :class:`EngineConfig`, used as given but
    for ``auto_process``) and ``_embedder`` (a ready-made embedder).
    """

    def __init__(
        self,
        user_id: str,
        openai_api_key: str | None = None,
        data_storage_path: str = "./memoryos_data",
        openai_base_url: str | None = None,
        assistant_id: str = _DEFAULT_ASSISTANT,
        short_term_capacity: int = 10,
        mid_term_capacity: int = 2000,
        long_term_knowledge_capacity: int = 100,
        retrieval_queue_capacity: int = 7,
        mid_term_heat_threshold: float = 5.0,
        mid_term_similarity_threshold: float = 0.6,
        llm_model: str | None = None,
        embedding_model_name: str | None = None,
        embedding_model_kwargs: dict | None = None,
        *,
        llm_backend: Any = None,
        llm_options: dict[str, Any] | None = None,
        preset: str = "reference",
        device: str = "auto",
        memory: dict[str, Any] | None = None,
        _engine_config: EngineConfig | None = None,
        _embedder: Any = None,
    ) -> None:
        if not isinstance(user_id, str) or not user_id.strip():
            raise ValueError("user_id must be a non-empty string")
        backend_obj = None if llm_backend is None or isinstance(llm_backend, str) else llm_backend
        # left out (None and "" too, as in config.json): the stored user's assistant, else the
        # reference's default; named: that one, refused if the user has another
        self._assistant_named = assistant_id not in (None, "") and (
            assistant_id is not _DEFAULT_ASSISTANT
        )
        if not self._assistant_named:
            assistant_id = DEFAULT_ASSISTANT_ID  # a plain str from here on
        s = settings(
            {
                "user_id": user_id,
                "openai_api_key": openai_api_key,
                "openai_base_url": openai_base_url,
                "data_storage_path": data_storage_path,
                "assistant_id": assistant_id,
                "short_term_capacity": short_term_capacity,
                "mid_term_capacity": mid_term_capacity,
                "long_term_knowledge_capacity": long_term_knowledge_capacity,
                "retrieval_queue_capacity": retrieval_queue_capacity,
                "mid_term_heat_threshold": mid_term_heat_threshold,
                "mid_term_similarity_threshold": mid_term_similarity_threshold,
                "llm_model": llm_model,
                "embedding_model_name": embedding_model_name,
                "embedding_model_kwargs": embedding_model_kwargs,
                # a ready backend object: LLM mode whatever the credentials say (the config
                # names some kind; the object is what runs)
                "llm_backend": "scripted" if backend_obj is not None else llm_backend,
                "llm_options": dict(llm_options or {}),
                "preset": preset,
                "device": device,
                "memory": dict(memory or {}),
            },
            "Memoryos",
        )
        self.user_id = user_id
        self.assistant_id = assistant_id
        self.data_storage_path = os.path.abspath(data_storage_path)
        self.llm_model = s.llm_model
        self._llm_backend = s.llm_backend
        config = _engine_config or engine_config(
            s,
            store=self.data_storage_path,
            # a ready embedder: no model folder to resolve
            embedder="hashing" if _embedder is not None else "transformers",
        )
        # derived work runs here after each add (not inside it), so an LLM failure there is
        # caught without losing the page id
        config = config.model_copy(update={"auto_process": False})
        self.engine = self._shared_engine(config, backend_obj, _embedder)
        self._closed = False

    # ------------------------------------------------------------------ engine sharing
    def _shared_engine(self, config: EngineConfig, llm: Any, embedder: Any) -> MemoryEngine:
        """The folder's engine, opened by the first facade; a later one must ask for the same
        memory and LLM settings (it would silently run on the first one's otherwise), and
        for a user the folder holds, that user's assistant_id."""
        with _ENGINES_LOCK:
            entry = _ENGINES.get(self.data_storage_path)
            if entry is None:
                _refuse_legacy_store(self.data_storage_path)
                engine = MemoryEngine(config, embedder=embedder, llm=llm)
                try:
                    self._check_assistant(engine)
                except BaseException:
                    engine.close()
                    raise
                _ENGINES[self.data_storage_path] = [engine, 1]
                return engine
            engine = entry[0]
            if _memory_differs(engine.memory, config.memory):
                raise ValueError(
                    f"{self.data_storage_path} is already open with other memory settings "
                    f"({engine.memory.model_dump()}); every Memoryos on one data_storage_path "
                    "shares one engine, so pass the same capacities and thresholds"
                )
            differing = _llm_difference(engine, config, llm)
            if differing is not None:
                raise ValueError(
                    f"{self.data_storage_path} is already open with another {differing}; every "
                    "Memoryos on one data_storage_path shares one engine and its LLM, so pass "
                    "the same LLM settings"
                )
            self._check_assistant(engine)
            entry[1] += 1
            return engine

    def _check_assistant(self, engine: MemoryEngine) -> None:
        """For a user the folder holds: take its assistant when ``assistant_id`` was left out;
        ValueError when another one was named (a user's assistant is fixed when the user is
        first stored, so the named one would be ignored)."""
        user = engine._users.get(self.user_id)
        if user is None or user.assistant_id == self.assistant_id:
            return
        if not self._assistant_named:
            self.assistant_id = user.assistant_id
            return
        raise ValueError(
            f"user {self.user_id!r} is stored in {self.data_storage_path} with assistant_id "
            f"{user.assistant_id!r}, not {self.assistant_id!r}; a user keeps one assistant "
            "(leave assistant_id out to use the stored one)"
        )

    def _assistant(self) -> str:
        """This facade's assistant now: when ``assistant_id`` was left out, the user's stored
        one (another way in may have filed the user since this facade opened)."""
        if not self._assistant_named:
            user = self.engine._users.get(self.user_id)
            if user is not None:
                self.assistant_id = user.assistant_id
        return self.assistant_id

    def close(self) -> None:
        """Release this facade; the shared engine closes with the last one of its folder."""
        if self._closed:
            return
        self._closed = True
        with _ENGINES_LOCK:
            entry = _ENGINES.get(self.data_storage_path)
            if entry is None or entry[0] is not self.engine:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del _ENGINES[self.data_storage_path]
                self.engine.close()

    def _check_open(self) -> None:
        """EngineClosedError once this facade is closed. Checked by every public method:
        the shared engine stays open while a sibling facade of the folder is, so without it
        a closed facade went on reading and writing its user's memory."""
        if self._closed:
            raise EngineClosedError("this Memoryos is closed")

    def __enter__(self) -> Memoryos:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reference API
    def add_memory(
        self,
        user_input: str,
        agent_response: str,
        timestamp: str | float | None = None,
        meta_data: dict | None = None,
    ) -> int:
        """Remember one exchange; returns its page id. As in the reference, when the call
        returns the page is stored and what it evicted from STM is in MTM (promotions included),
        unless the LLM failed: then that derived work stays pending and a later call retries it.

        A ``timestamp`` that does not parse, or a ``meta_data`` that is not a dict (a JSON
        object) or None, raises :class:`~memoryos_gpu.engine.InvalidInputError` (a
        ``ValueError``) naming the argument. The reference ignores ``meta_data``; here it is
        kept with the page (its ``extra``: ``export``, the HTTP API and the engine's retrievals
        show it; :meth:`retrieve_context`'s ``meta_info`` is the chain's summary), so a value that
        cannot be kept is refused rather than dropped.
        """
        self._check_open()
        try:
            # "" is now, as in the reference (its `timestamp or now`); 0 is the epoch
            epoch, kept = read_timestamp(None if timestamp == "" else timestamp)
        except ValueError as exc:
            hint = _TIMESTAMP_HINT if "expected ISO-8601" in str(exc) else ""
            raise InvalidInputError(f"timestamp: {exc}{hint}") from None
        meta = user_meta(_checked_meta_data(meta_data), kept)
        named = self._assistant_named
        (result,) = self.engine.add_many(
            [
                PageInput(
                    self.user_id,
                    user_input,
                    agent_response if agent_response is not None else "",
                    epoch,
                    # left out: the user's own (a new user's is the reference's default)
                    assistant_id=self.assistant_id if named else None,
                    meta=meta,
                    default_assistant=None if named else DEFAULT_ASSISTANT_ID,
                )
            ]
        )
        self._assistant()
        self._process()
        return result.page_id

    def _process(self) -> None:
        """Run the derived work now; an unusable LLM is logged, not raised (the reference's
        LLM calls return error text instead of raising)."""
        try:
            self.engine.process_pending()
        except LLMBackendError as exc:
            log.warning("derived work deferred (it stays pending): the LLM failed: %s", exc)

    def retrieve_context(self, query: str) -> dict[str, Any]:
        """The reference retriever's result: pages, user knowledge and assistant knowledge
        (``{knowledge, timestamp}``; pages and knowledge also carry their ``score``).

        Updates heat like any retrieval. A user with no memory yet gets empty lists.
        """
        self._check_open()
        try:
            r = self.engine.retrieve(self.user_id, query)
        except UnknownUserError:
            return {
                "retrieved_pages": [],
                "retrieved_user_knowledge": [],
                "retrieved_assistant_knowledge": self._assistant_entries(),
                "retrieved_at": stamp(),
            }
        created = self._knowledge_created()
        return {
            "retrieved_pages": [
                {
                    "page_id": p.page_id,
                    "user_input": p.user_input,
                    "agent_response": p.agent_response,
                    "timestamp": page_stamp(p),
                    "meta_info": p.meta or "",
                    "score": p.score,
                }
                for p in r.pages
            ],
            "retrieved_user_knowledge": _knowledge(r.user_knowledge, created),
            "retrieved_assistant_knowledge": _knowledge(r.assistant_knowledge, created),
            "retrieved_at": stamp(),
        }

    def get_response(
        self,
        query: str,
        relationship_with_user: str = "friend",
        style_hint: str = "",
        user_conversation_meta_data: dict | None = None,
    ) -> str:
        """Answer ``query`` with memory (STM, retrieved pages, profile, knowledge) and remember
        the exchange. Without an LLM configured it raises :class:`MemoryOSError` saying how to
        configure one; when the LLM fails it returns the reference's error text
        (``"Error: Could not get response from LLM."``) and remembers nothing. An answer longer
        than ``llm.max_tokens`` allows (:func:`~memoryos_gpu.engine.responses.answer_limit`)
        counts as a failure, as ``POST /v1/users/{id}/respond`` refuses it: the LLM server
        ignored the bound, and remembering it would put an unbounded page in every later
        prompt."""
        self._check_open()
        eng = self.engine
        if eng.stages.mode != "llm":
            raise MemoryOSError(_llm_help(self._llm_backend))
        messages = self._response_prompt(
            query, relationship_with_user, style_hint, user_conversation_meta_data
        )
        try:
            (result,) = eng.stages.respond([messages])
        except LLMBackendError as exc:
            log.warning("get_response: the LLM failed: %s", exc)
            return LLM_ERROR_TEXT
        if result.error:
            log.warning("get_response: the LLM failed: %s", result.error)
            return LLM_ERROR_TEXT
        text = result.text or ""
        if why := too_long(text, eng.stages.max_tokens):
            log.warning("get_response: no usable answer from the LLM (nothing remembered): %s", why)
            return LLM_ERROR_TEXT
        self.add_memory(query, text)
        eng.counters["responses"] += 1
        return text

    def _response_prompt(
        self, query: str, relationship: str, style_hint: str, meta: dict | None
    ) -> list[dict[str, str]]:
        """The response prompt: memory for ``query`` and the reference's per-call hints."""
        try:
            r = self.engine.retrieve(self.user_id, query)
            stm, pages = _page_dicts(r.stm), _page_dicts(r.pages)
            profile: Any = r.profile
            user_facts = [e.text for e in r.user_knowledge]
            assistant_facts = [e.text for e in r.assistant_knowledge]
        except UnknownUserError:  # first message of a new user: no memory yet
            stm, pages, profile, user_facts = [], [], {}, []
            assistant_facts = [e["knowledge"] for e in self._assistant_entries()]
        extra = [f"Your relationship with the user: {relationship}."]
        if style_hint:
            extra.append(f"Style: {style_hint}")
        if meta:
            extra.append(
                f"Conversation metadata: {json.dumps(meta, ensure_ascii=False, default=str)}"
            )
        return prompts.response(
            query,
            stm,
            pages,
            profile,
            user_facts,
            assistant_facts,
            self._assistant(),
            now=stamp(),
            extra_instructions="\n".join(extra),
        )

    def get_user_profile_summary(self) -> str:
        """The user profile as text (``"None"`` while nothing is known, like the reference)."""
        self._check_open()
        try:
            profile = self.engine.profile(self.user_id)
        except UnknownUserError:
            return "None"
        return render_profile(profile, include_unknown=True, empty_text="None")

    def get_assistant_knowledge_summary(self) -> list[dict[str, str]]:
        """Every live assistant-knowledge entry, oldest first: ``{"knowledge", "timestamp"}``."""
        self._check_open()
        return self._assistant_entries()

    def force_mid_term_analysis(self) -> bool:
        """Promote the hottest segment that has unanalysed pages now, whatever its heat (the
        reference's manual trigger). Returns whether anything was analysed."""
        self._check_open()
        eng = self.engine
        try:
            exported = eng.export_user(self.user_id)
        except UnknownUserError:
            return False
        pending = {p["segment_id"] for p in exported["pages"] if not p["analysed"]}
        candidates = [s for s in exported["segments"] if s["segment_id"] in pending]
        if not candidates:
            return False
        m = eng.memory
        now = max(s["last_access"] for s in exported["segments"])

        def heat(s: dict[str, Any]) -> float:
            dt = max(0.0, now - s["last_access"])
            return (
                m.alpha * s["n_visit"]
                + m.beta * s["l_interaction"]
                + m.gamma * math.exp(-dt / m.mu_seconds)
            )

        hottest = max(candidates, key=heat)["segment_id"]
        with eng.store.transaction() as db:
            db.execute(
                "INSERT INTO pending(user_id, kind, ref, created) "
                "VALUES (?, 'promote', ?, ?) ON CONFLICT DO NOTHING",
                (self.user_id, int(hottest), time.time()),
            )
        self._process()
        return True

    def get_memory_stats(self) -> dict[str, Any]:
        """Counts per tier for this user (the reference's keys plus a few more)."""
        self._check_open()
        stats: dict[str, Any] = {"user_id": self.user_id}
        try:
            data = self.engine.export_user(self.user_id)
        except UnknownUserError:
            data = None
        pages = data["pages"] if data else []
        profile = data["user"]["profile"] if data else {}
        stats.update(
            short_term_count=sum(p["tier"] == "stm" for p in pages),
            mid_term_sessions_count=len(data["segments"]) if data else 0,
            mid_term_pages_count=sum(p["tier"] == "mtm" for p in pages),
            pending_count=sum(p["tier"] == "pending" for p in pages),
            has_user_profile=bool(profile),
            user_knowledge_count=sum(e["live"] for e in data["user_knowledge"]) if data else 0,
            assistant_knowledge_count=len(self._assistant_entries()),
            mode=self.engine.stages.mode,
        )
        return stats

    # ------------------------------------------------------------------ helpers
    def _assistant_entries(self) -> list[dict[str, str]]:
        rows = self.engine.store.owner_knowledge("assistant", self._assistant())
        return [{"knowledge": e["text"], "timestamp": stamp(e["created"])} for e in rows]

    def _knowledge_created(self) -> dict[int, float]:
        kn = self.engine.knowledge(self.user_id)
        return {e["entry_id"]: e["created"] for e in (*kn["user"], *kn["assistant"])}

    def __repr__(self) -> str:
        return (
            f"<Memoryos user_id={self.user_id!r} assistant_id={self.assistant_id!r} "
            f"data_path={self.data_storage_path!r} mode={self.engine.stages.mode!r}>"
        )


# what a refused timestamp's message adds: the forms migrating code passes most
_TIMESTAMP_HINT = (
    " (the reference's own 'YYYY-MM-DD HH:MM:SS', local time, is accepted; leave timestamp "
    "out for now)"
)


def _checked_meta_data(meta_data: Any) -> Mapping[str, Any] | None:
    """``meta_data`` if it is a dict (any mapping) or None, else InvalidInputError naming it:
    the page keeps it, and ``dict([1])`` failed with an error that named nothing."""
    if meta_data is None or isinstance(meta_data, Mapping):
        return meta_data
    raise InvalidInputError(
        f"meta_data must be a dict (a JSON object) or None, got {type(meta_data).__name__}; "
        "it is kept with the page (the reference ignored it): wrap other values, e.g. "
        "meta_data={'value': ...}"
    )


def _memory_differs(a: MemoryConfig, b: MemoryConfig) -> bool:
    return a.model_dump() != b.model_dump()


# the Memoryos argument each LLMConfig field comes from (the others: only _engine_config sets)
_LLM_ARGUMENT = {
    "mode": "llm_backend",
    "backend": "llm_backend",
    "model": "llm_model",
    "base_url": "openai_base_url",
    "api_key": "openai_api_key",
    "options": "llm_options",
}


def _llm_difference(engine: MemoryEngine, config: EngineConfig, llm: Any) -> str | None:
    """The LLM setting a facade asks for that differs from the shared engine's, in words (no
    value: an API key must not reach a message), or None when they agree. A ready backend
    object differs unless it is the engine's own; a facade passing none uses the engine's."""
    if llm is not None and llm is not engine.llm:
        return "LLM backend object (llm_backend)"
    ours, theirs = engine.config.llm.model_dump(), config.llm.model_dump()
    names = [_LLM_ARGUMENT.get(f, f"llm.{f}") for f, v in ours.items() if theirs[f] != v]
    return f"LLM setting ({', '.join(dict.fromkeys(names))})" if names else None


def _refuse_legacy_store(folder: str) -> None:
    """A folder this facade wrote before it shared the MCP server's file name: say how to keep
    its memory rather than silently starting an empty store beside it."""
    old, new = os.path.join(folder, LEGACY_STORE_FILE), os.path.join(folder, "memory.sqlite3")
    if os.path.exists(old) and not os.path.exists(new):
        raise MemoryOSError(
            f"{old} is this facade's old store file; rename it to {new} (the file the MCP "
            "server and --store use for this folder) to keep its memory"
        )


def _knowledge(entries: Any, created: dict[int, float]) -> list[dict[str, Any]]:
    """Knowledge entries in the reference's shape (plus the score)."""
    return [
        {
            "knowledge": e.text,
            "timestamp": _stamp_or_blank(created.get(e.entry_id)),
            "score": e.score,
        }
        for e in entries
    ]


def _stamp_or_blank(ts: float | None) -> str:
    return "" if ts is None else stamp(ts)


def _page_dicts(pages: Any) -> list[dict[str, Any]]:
    return [
        {
            "user_input": p.user_input,
            "agent_response": p.agent_response,
            "timestamp": page_stamp(p),
            "meta": p.meta,
        }
        for p in pages
    ]
