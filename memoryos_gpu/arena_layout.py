"""The arena's shape and the values its rows hold: :class:`ArenaConfig` (slots of each kind,
block size, device), the entries that mean "nothing" (``KEYWORD_PAD`` in a keyword row,
``NO_ID`` in a block table or an id column) and keyword rows in the form the kernels require
(:func:`normalize_keyword_rows`).

Why a module of its own: every other arena module reads these (the backend pads keyword rows,
the page pool and growth fill block tables), so they sit below all of them and depend on
nothing of the arena. The engine and the reference kernels import them from
:mod:`memoryos_gpu.arena`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEYWORD_PAD = -1
NO_ID = -1
_INT32_MAX = np.iinfo(np.int32).max


def normalize_keyword_rows(rows: np.ndarray) -> np.ndarray:
    """Rows of keyword ids as the kernels require them: sorted, unique, padded at the end.

    Vectorised (no per-row Python): negative entries count as padding, duplicates collapse.
    """
    r = np.sort(np.asarray(rows, dtype=np.int32), axis=1)
    drop = r < 0
    drop[:, 1:] |= r[:, 1:] == r[:, :-1]
    r[drop] = _INT32_MAX
    r.sort(axis=1)
    r[r == _INT32_MAX] = KEYWORD_PAD
    return r


@dataclass(frozen=True)
class ArenaConfig:
    """Shape of the arena. Defaults follow the paper (200 segments, 100 knowledge entries)."""

    dim: int = 384
    segment_slots: int = 200  # segments a user may hold (the paper's MTM capacity)
    # segment slots each user has room for at first; the arena widens by doubling up to
    # segment_slots when a user needs more (rows of [users, slots, ...] cost memory for every
    # user: 200 slots at 100,000 users is 15 GB of fp16 segment rows on a GPU)
    initial_segment_slots: int = 8
    keyword_width: int = 32
    # pages per block; None: 1 on the host (a wide block table costs nothing there, see
    # Arena.__init__, and a one-page segment, the common case without an LLM, wastes no
    # slot), 4 on a GPU (the device block table is dense: U x S x ceil(pages / 4) entries)
    block_size: int | None = None
    knowledge_capacity: int = 100  # live entries a ring holds (the paper's LPM capacity)
    # ring positions each owner has room for at first; the rings widen by doubling up to
    # knowledge_capacity when an owner's ring needs more ([owners, R, d] rows cost memory for
    # every owner: 100 fp16 rows of 384 dimensions are 77 KB an owner on a GPU)
    initial_knowledge_slots: int = 8
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    gpu_dtype: str = "float16"  # "float16" or "bfloat16" (CPU always stores float32)
    initial_users: int = 16
    initial_blocks: int = 256
    initial_owners: int = 16
    # a user with at least this many indexed MTM pages also gets BM25 postings (CPU arena):
    # its queries touch only their own terms' pages instead of scanning every page's row
    # (memoryos_gpu.arena_lexical); 0: never
    postings_min_pages: int = 256

    def __post_init__(self) -> None:
        if self.block_size is None:
            object.__setattr__(self, "block_size", 4 if self.device.startswith("cuda") else 1)
        names = ("dim", "segment_slots", "initial_segment_slots", "keyword_width")
        for name in (*names, "block_size", "knowledge_capacity", "initial_knowledge_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"ArenaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.postings_min_pages < 0:
            raise ValueError(
                f"ArenaConfig.postings_min_pages must be >= 0, got {self.postings_min_pages}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"ArenaConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.gpu_dtype not in ("float16", "bfloat16"):
            raise ValueError(
                f"ArenaConfig.gpu_dtype must be float16 or bfloat16, got {self.gpu_dtype}"
            )
