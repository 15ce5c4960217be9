"""Allocation and scatter writes for one device: :class:`_Backend` is where the arena's arrays
differ between NumPy on the CPU and torch on CUDA (allocating, growing with the old rows kept,
copying to and from the device, writing ranges and scattered entries).

Why a class of its own: the arena's methods, and the lexical rows
(:class:`~memoryos_gpu.arena_lexical.LexicalRows`), then read the same on both devices; on the
CPU its allocations are the lazily backed arrays of :mod:`memoryos_gpu.arena_memory`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memoryos_gpu.arena_layout import KEYWORD_PAD
from memoryos_gpu.arena_memory import grow_in_place, lazy_zeros, move_live_rows
from memoryos_gpu.errors import ArenaError


class _Backend:
    """Allocation and scatter writes for one device (NumPy on CPU, torch on CUDA)."""

    def __init__(self, device: str, gpu_dtype: str) -> None:
        self.device = device
        self.on_cuda = device.startswith("cuda")
        if self.on_cuda:
            import torch

            if not torch.cuda.is_available():
                raise ArenaError(f"device {device!r} requested but torch sees no CUDA device")
            self.torch = torch
            self.emb_dtype = getattr(torch, gpu_dtype)
        else:
            self.torch = None
            self.emb_dtype = np.float32
        # what a dead segment's keyword row holds: padding on the device, on the host nothing
        # written (zero), so that empty rows are never made resident
        self.dead_kw = KEYWORD_PAD if self.on_cuda else 0

    def full(self, shape: tuple[int, ...], value: Any, dtype: Any) -> Any:
        if self.on_cuda:
            return self.torch.full(shape, value, dtype=self._tdtype(dtype), device=self.device)
        if value == 0:  # lazily backed and growable in place (lazy_zeros)
            return lazy_zeros(shape, dtype)
        return np.full(shape, value, dtype=dtype)

    def empty_emb(self, shape: tuple[int, ...], dense: bool = False) -> Any:
        """Zeroed embedding rows; ``dense``: written from the first row on (host: huge pages,
        see :func:`lazy_zeros`)."""
        if self.on_cuda:
            return self.torch.zeros(shape, dtype=self.emb_dtype, device=self.device)
        return lazy_zeros(shape, np.float32, huge=dense)

    def to_device(self, array: np.ndarray, emb: bool = False) -> Any:
        if not self.on_cuda:
            return np.ascontiguousarray(array, dtype=np.float32 if emb else array.dtype)
        t = self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=False)
        return t.to(self.emb_dtype) if emb else t

    def to_host(self, array: Any) -> np.ndarray:
        if not self.on_cuda:
            return array
        t = array.detach()
        if t.dtype in (self.torch.float16, self.torch.bfloat16):
            t = t.float()
        return t.cpu().numpy()

    def grow(
        self,
        array: Any,
        new_len: int,
        fill: Any,
        axis: int = 0,
        live: np.ndarray | None = None,
        dense: bool = False,
    ) -> Any:
        """Return ``array`` extended along ``axis`` to ``new_len``, old contents kept.

        ``live`` (the shape of ``array``'s leading dimensions): on the CPU, with a zero fill,
        only those rows are kept, so growing never touches the memory of empty rows (on CUDA
        it is ignored: the device copy is one kernel either way). ``dense``: a new host
        allocation asks for huge pages (:func:`lazy_zeros`).
        """
        shape = list(array.shape)
        extra = new_len - shape[axis]
        if extra <= 0:
            return array
        # One allocation of the new size, old rows copied in: the peak is old + new, not
        # old + padding + new as with a concatenate (at 10,000 users x 200 segments the page
        # pool alone is gigabytes). Zero fills use zeroed allocations the OS maps lazily.
        old = shape[axis]
        shape[axis] = new_len
        head = (slice(None),) * axis + (slice(0, old),)
        tail = (slice(None),) * axis + (slice(old, None),)
        if self.on_cuda:
            out = self.torch.empty(shape, dtype=array.dtype, device=array.device)
            out[tail] = fill
        elif fill == 0 and axis == 0 and (same := grow_in_place(array, new_len)) is not None:
            return same  # the reservation had room: nothing copied
        elif fill == 0:
            out = lazy_zeros(tuple(shape), array.dtype, huge=dense)
            if live is not None:
                move_live_rows(out, array, live)
                return out
        else:
            out = np.empty(shape, dtype=array.dtype)
            out[tail] = fill
        out[head] = array
        return out

    def write_range(self, target: Any, start: int, values: np.ndarray) -> None:
        """``target[start:start + len(values)] = values`` (one copy to the device on CUDA)."""
        if values.size == 0:
            return
        if self.on_cuda:
            values = self.torch.from_numpy(np.ascontiguousarray(values)).to(target.device)
        target[start : start + values.shape[0]] = values

    def scatter(self, target: Any, index: np.ndarray, values: np.ndarray) -> None:
        """``target[index] = values`` for 1-D targets."""
        if not self.on_cuda:
            target[index] = values
            return
        t = self.torch
        idx = t.as_tensor(np.asarray(index, np.int64), device=target.device)
        target[idx] = t.from_numpy(np.ascontiguousarray(values)).to(target.device, target.dtype)

    def gather_to_new(self, source: Any, index: np.ndarray, length: int) -> Any:
        """A new int32 1-D array of ``length`` (zero-padded) with ``source[index]`` in front."""
        out = self.full((length,), 0, np.int32)
        if index.size:
            if self.on_cuda:
                idx = self.torch.as_tensor(index, device=source.device)
                out[: index.size] = source[idx]
            else:
                out[: index.size] = source[index]
        return out

    def _tdtype(self, dtype: Any) -> Any:
        return {
            np.float32: self.torch.float32,
            np.float64: self.torch.float64,
            np.int32: self.torch.int32,
            np.int64: self.torch.int64,
            np.uint8: self.torch.uint8,
        }[np.dtype(dtype).type]
