"""Drop-in facade with the method names of the reference ``memoryos`` package (BAI-LAB/MemoryOS).

Code written against the reference switches by changing one import::

    # from memoryos import Memoryos
    from memoryos_gpu.compat import Memoryos

    memo = Memoryos(user_id="alice", openai_api_key=KEY, data_storage_path="./mem")
    memo.add_memory("I adopted a cat named Miso.", "Congratulations!")
    print(memo.get_response("What is my cat called?"))

Differences a user should know:

* Every ``Memoryos`` with the same ``data_storage_path`` shares one
  :class:`~memoryos_gpu.engine.MemoryEngine` (one SQLite file ``memoryos.sqlite`` in that folder),
  so many users are batched together. The memory settings (capacities, thresholds) belong to
  that shared engine: opening the same folder with different settings raises ``ValueError``.
* Defaults are the paper's (``short_term_capacity=7``, ``mid_term_capacity=200``, heat eviction,
  ``mu`` = 1e7 s); pass ``preset="reference"`` for the reference code's defaults.
* With ``openai_api_key`` and/or ``openai_base_url`` the LLM work goes to that OpenAI-compatible
  server (``llm_model`` names the model). Without either, memory runs LLM-free ("extractive"
  mode: embedding continuity, keyword summaries, first-person facts) and :meth:`get_response`
  raises :class:`~memoryos_gpu.errors.MemoryOSError` explaining how to configure an LLM.
* The reference's JSON files are not read; timestamps may be epoch seconds or ISO strings
  (the reference's ``"YYYY-MM-DD HH:MM:SS"`` works).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any

from memoryos_gpu import prompts
from memoryos_gpu.config import EngineConfig, LLMConfig, MemoryConfig, preset
from memoryos_gpu.engine import MemoryEngine
from memoryos_gpu.errors import MemoryOSError, UnknownUserError
from memoryos_gpu.profile_dims import render_profile

__all__ = ["Memoryos", "close_all"]

DEFAULT_ASSISTANT_ID = "default_assistant_profile"
OPENAI_BASE_URL = "https://api.openai.com/v1"
STORE_FILE = "memoryos.sqlite"
_MINILM_NAMES = {
    "all-minilm-l6-v2",
    "sentence-transformers/all-minilm-l6-v2",
}

_LLM_HELP = (
    "get_response needs an LLM, and this Memoryos runs LLM-free (no openai_api_key or "
    "openai_base_url was given). Pass openai_api_key=... (OpenAI) and/or "
    "openai_base_url='http://host:port/v1' (any OpenAI-compatible server: vLLM, llama.cpp, "
    "Ollama) with llm_model='<served model name>'; or build a memoryos_gpu.MemoryEngine with "
    "LLMConfig(mode='llm', backend='vllm' | 'transformers'). Memory itself (add_memory, "
    "retrieve_context, profile and knowledge extraction) works without an LLM."
)

# one engine per storage folder: {abs path: [engine, open facades]}
_ENGINES: dict[str, list[Any]] = {}
_ENGINES_LOCK = threading.Lock()


def _format_ts(ts: float | None) -> str:
    """Epoch seconds as the reference's ``YYYY-MM-DD HH:MM:SS`` (UTC)."""
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(ts)))


def close_all() -> None:
    """Close every shared engine (tests; interpreter shutdown closes SQLite anyway)."""
    with _ENGINES_LOCK:
        for engine, _ in _ENGINES.values():
            engine.close()
        _ENGINES.clear()


class Memoryos:
    """One user's memory with the reference implementation's API, on a shared batch engine.

    Parameters follow the reference's ``Memoryos.__init__`` in the same positional order;
    ``embedding_model_name`` ``None`` / ``"all-MiniLM-L6-v2"`` selects the bundled MiniLM, any
    other value is a local model folder. Extra keywords: ``preset`` (``"paper"`` or
    ``"reference"``), ``device`` (``"auto"``, ``"cpu"``, ``"cuda"``), ``memory`` (a dict of
    further :class:`~memoryos_gpu.config.MemoryConfig` overrides), and for tests
    ``_engine_config`` (a full :class:`EngineConfig`, used as given), ``_llm`` and
    ``_embedder`` (ready-made backend / embedder objects).
    """

    def __init__(
        self,
        user_id: str,
        openai_api_key: str | None = None,
        data_storage_path: str = "./memoryos_data",
        openai_base_url: str | None = None,
        assistant_id: str = DEFAULT_ASSISTANT_ID,
        short_term_capacity: int = 7,
        mid_term_capacity: int = 200,
        long_term_knowledge_capacity: int = 100,
        retrieval_queue_capacity: int = 7,
        mid_term_heat_threshold: float = 5.0,
        mid_term_similarity_threshold: float = 0.6,
        llm_model: str = "gpt-4o-mini",
        embedding_model_name: str | None = None,
        embedding_model_kwargs: dict | None = None,
        **kw: Any,
    ) -> None:
        if not isinstance(user_id, str) or not user_id.strip():
            raise ValueError("user_id must be a non-empty string")
        engine_config = kw.pop("_engine_config", None)
        llm = kw.pop("_llm", None)
        embedder = kw.pop("_embedder", None)
        preset_name = kw.pop("preset", "paper")
        device = kw.pop("device", "auto")
        memory_overrides = dict(kw.pop("memory", {}) or {})
        if kw:
            raise TypeError(f"Memoryos got unexpected keyword argument(s): {sorted(kw)}")
        del embedding_model_kwargs  # sentence-transformers options: nothing to pass on here

        self.user_id = user_id
        self.assistant_id = assistant_id
        self.data_storage_path = os.path.abspath(data_storage_path)
        self.llm_model = llm_model
        if engine_config is None:
            memory = preset(
                preset_name,
                **{
                    "stm_capacity": short_term_capacity,
                    "mtm_capacity": mid_term_capacity,
                    "knowledge_capacity": long_term_knowledge_capacity,
                    "top_pages": retrieval_queue_capacity,
                    "tau": mid_term_heat_threshold,
                    "theta": mid_term_similarity_threshold,
                    **memory_overrides,
                },
            )
            uses_llm = bool(openai_api_key or openai_base_url) or llm is not None
            llm_config = (
                LLMConfig(
                    mode="llm",
                    backend="openai",
                    model=llm_model,
                    base_url=openai_base_url or OPENAI_BASE_URL,
                    api_key=openai_api_key,
                )
                if uses_llm
                else LLMConfig(mode="extractive")
            )
            name = (embedding_model_name or "").strip()
            engine_config = EngineConfig(
                memory=memory,
                llm=llm_config,
                store=os.path.join(self.data_storage_path, STORE_FILE),
                device=device,
                embedding_model=None if name.lower() in _MINILM_NAMES | {""} else name,
            )
        self.engine = self._shared_engine(engine_config, llm, embedder)
        self._closed = False

    # ------------------------------------------------------------------ engine sharing
    def _shared_engine(self, config: EngineConfig, llm: Any, embedder: Any) -> MemoryEngine:
        with _ENGINES_LOCK:
            entry = _ENGINES.get(self.data_storage_path)
            if entry is None:
                if config.store != ":memory:":
                    os.makedirs(os.path.dirname(config.store) or ".", exist_ok=True)
                engine = MemoryEngine(config, embedder=embedder, llm=llm)
                _ENGINES[self.data_storage_path] = [engine, 1]
                return engine
            engine = entry[0]
            if _memory_differs(engine.memory, config.memory):
                raise ValueError(
                    f"{self.data_storage_path} is already open with other memory settings "
                    f"({engine.memory.model_dump()}); every Memoryos on one data_storage_path "
                    "shares one engine, so pass the same capacities and thresholds"
                )
            entry[1] += 1
            return engine

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
        """Remember one exchange (committed before return); returns its page id."""
        result = self.engine.add(
            self.user_id,
            user_input,
            agent_response if agent_response is not None else "",
            timestamp=timestamp or None,
            assistant_id=self.assistant_id,
            meta=dict(meta_data or {}),
        )
        return result.page_id

    def retrieve_context(self, query: str) -> dict[str, Any]:
        """The reference retriever's result: pages, user knowledge and assistant knowledge.

        Updates heat like any retrieval. A user with no memory yet gets empty lists.
        """
        try:
            r = self.engine.retrieve(self.user_id, query)
        except UnknownUserError:
            return {
                "retrieved_pages": [],
                "retrieved_user_knowledge": [],
                "retrieved_assistant_knowledge": self._assistant_entries(),
                "retrieved_at": _format_ts(time.time()),
            }
        created = self._knowledge_created()
        return {
            "retrieved_pages": [
                {
                    "page_id": p.page_id,
                    "user_input": p.user_input,
                    "agent_response": p.agent_response,
                    "timestamp": _format_ts(p.timestamp),
                    "meta_info": p.meta or "",
                    "score": p.score,
                }
                for p in r.pages
            ],
            "retrieved_user_knowledge": [
                {"knowledge": e.text, "timestamp": _format_ts(created.get(e.entry_id))}
                for e in r.user_knowledge
            ],
            "retrieved_assistant_knowledge": [
                {"knowledge": e.text, "timestamp": _format_ts(created.get(e.entry_id))}
                for e in r.assistant_knowledge
            ],
            "retrieved_at": _format_ts(time.time()),
        }

    def get_response(
        self,
        query: str,
        relationship_with_user: str = "friend",
        style_hint: str = "",
        user_conversation_meta_data: dict | None = None,
    ) -> str:
        """Answer ``query`` with memory (STM, retrieved pages, profile, knowledge) and remember
        the exchange. Raises :class:`MemoryOSError` without an LLM, or when the LLM fails."""
        eng = self.engine
        if eng.stages.mode != "llm":
            raise MemoryOSError(_LLM_HELP)
        try:
            r = eng.retrieve(self.user_id, query)
            stm, pages = _page_dicts(r.stm), _page_dicts(r.pages)
            profile: Any = r.profile
            user_facts = [e.text for e in r.user_knowledge]
            assistant_facts = [e.text for e in r.assistant_knowledge]
        except UnknownUserError:  # first message of a new user: no memory yet
            stm, pages, profile, user_facts = [], [], {}, []
            assistant_facts = [e["knowledge"] for e in self._assistant_entries()]
        extra = [f"Your relationship with the user: {relationship_with_user}."]
        if style_hint:
            extra.append(f"Style: {style_hint}")
        if user_conversation_meta_data:
            meta = json.dumps(user_conversation_meta_data, ensure_ascii=False, default=str)
            extra.append(f"Conversation metadata: {meta}")
        messages = prompts.response(
            query,
            stm,
            pages,
            profile,
            user_facts,
            assistant_facts,
            self.assistant_id,
            now=time.time(),
            extra_instructions="\n".join(extra),
        )
        (result,) = eng.stages.respond([messages])
        if result.error:
            raise MemoryOSError(f"the LLM failed to answer: {result.error}")
        text = result.text or ""
        self.add_memory(query, text)
        eng.counters["responses"] += 1
        return text

    def get_user_profile_summary(self) -> str:
        """The user profile as text (``"None"`` while nothing is known, like the reference)."""
        try:
            profile = self.engine.profile(self.user_id)
        except UnknownUserError:
            return "None"
        return render_profile(profile, include_unknown=True, empty_text="None")

    def get_assistant_knowledge_summary(self) -> list[dict[str, str]]:
        """Every live assistant-knowledge entry, oldest first: ``{"knowledge", "timestamp"}``."""
        return self._assistant_entries()

    def force_mid_term_analysis(self) -> bool:
        """Promote the hottest segment that has unanalysed pages now, whatever its heat (the
        reference's manual trigger). Returns whether anything was analysed."""
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
        eng.flush()
        return True

    def get_memory_stats(self) -> dict[str, Any]:
        """Counts per tier for this user (the reference's keys plus a few more)."""
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
        rows = self.engine.store.owner_knowledge("assistant", self.assistant_id)
        return [{"knowledge": e["text"], "timestamp": _format_ts(e["created"])} for e in rows]

    def _knowledge_created(self) -> dict[int, float]:
        kn = self.engine.knowledge(self.user_id)
        return {e["entry_id"]: e["created"] for e in (*kn["user"], *kn["assistant"])}

    def __repr__(self) -> str:
        return (
            f"<Memoryos user_id={self.user_id!r} assistant_id={self.assistant_id!r} "
            f"data_path={self.data_storage_path!r} mode={self.engine.stages.mode!r}>"
        )


def _memory_differs(a: MemoryConfig, b: MemoryConfig) -> bool:
    return a.model_dump() != b.model_dump()


def _page_dicts(pages: Any) -> list[dict[str, Any]]:
    return [
        {
            "user_input": p.user_input,
            "agent_response": p.agent_response,
            "timestamp": p.timestamp,
            "meta": p.meta,
        }
        for p in pages
    ]
