"""Host buffers: turning user arrays into what the algorithms want, and back.

The algorithms work on one contiguous 1-D array. This module is the
boundary that gets them one:

* :func:`as_flat` - any-shape, possibly strided numpy array -> contiguous 1-D
  array (a view when the layout allows, a copy only when it must);
* :func:`restore` - write a flat result back into the caller's array;
* :class:`Workspace` - scratch buffers kept between calls, so the hot loop
  of an algorithm never allocates after the first call of a given size;
* :class:`ResultPool` - memory for results handed to callers, recycled once
  the caller has let go of it (as TensorFlow's allocator recycles tensors);
* :class:`Pieces` - several 1-D arrays of one dtype seen as one buffer back to
  back, with no copy into a joint array (the engine's large gradients, which
  ``shm`` reduces in one stream of windows);
* :func:`is_device_array` - the one place that decides host versus device.
  Device arrays go to :func:`device_allreduce` (:mod:`allreduce.device`:
  staged through pinned host memory, or CUDA IPC), everything else is host.
"""
from __future__ import annotations

import bisect
import sys
import threading

import numpy as np

__all__ = ["Workspace", "ResultPool", "aligned_empty", "Pieces", "parts", "as_flat", "restore", "is_device_array", "device_allreduce"]


class Workspace:
    """Named scratch buffers, grown on demand and reused across calls."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}
        self._views: dict[tuple, np.ndarray] = {}   # (key, count, dtype) -> view: the hot path's answer

    def get(self, key: str, count: int, dtype) -> np.ndarray:
        """A 1-D array of ``count`` elements of ``dtype``; contents are undefined."""
        view = self._views.get((key, count, dtype))
        if view is not None:         # a small message costs a few microseconds: this saves one or two
            return view
        dt = np.dtype(dtype)
        nbytes = count * dt.itemsize
        buf = self._bufs.get(key)
        if buf is None or len(buf) < nbytes:
            # Round up to a power of two so a slowly growing size reallocates O(log n) times.
            size = 1 << max(6, (nbytes - 1).bit_length())
            buf = self._bufs[key] = np.empty(size, dtype=np.uint8)
            self._views = {k: v for k, v in self._views.items() if k[0] != key}   # views of the old one
        view = buf[:nbytes].view(dt)
        if len(self._views) >= 512:  # many distinct sizes (the engine's fused batches): start over
            self._views.clear()
        self._views[(key, count, dtype)] = view
        return view

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()
        self._views.clear()


ALIGN = 64
"""Bytes a pooled result's address is a multiple of. TensorFlow wraps a numpy array in a tensor
without a copy only where the data is 64-byte aligned (its Eigen alignment); numpy's own large
arrays start 16 bytes into a page, so tfops' eager results were copied: 16 MiB took 8.9 ms to wrap
(a fresh TF buffer, page faults included) against 6 us aligned, by hand on the 2-core VM."""


def _aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``raw`` from its first ``ALIGN``-byte boundary. numpy points every view at
    ``raw`` itself (the array that owns the memory), so ``raw``'s reference count still says
    when a caller is done with it."""
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


def aligned_empty(count: int, dtype) -> np.ndarray:
    """A new 1-D array of ``count`` elements of ``dtype`` whose data starts ``ALIGN``-byte aligned:
    TensorFlow takes it as a tensor without a copy (``tf.numpy_function``'s results included)."""
    dtype = np.dtype(dtype)
    return _aligned(np.empty(count * dtype.itemsize + ALIGN, np.uint8), count * dtype.itemsize).view(dtype)


def _unused(blocks: list, i: int) -> bool:
    """True when nothing but ``blocks`` refers to ``blocks[i]`` (CPython reference counts)."""
    return sys.getrefcount(blocks[i]) <= _FREE_REFS


class ResultPool:
    """Memory for results handed to callers, reused once the caller has let go of it.

    A fresh large array is expensive: the kernel zeroes each page on first
    touch, so writing 100 MB into new memory took ~15 ms on the 2-core VM
    against ~5 ms into memory written before. The engine hands out new
    result arrays every step, of the same sizes every step, and training
    drops the last step's before the next; TensorFlow's own allocator
    recycles tensor memory for the same reason.

    A block is free when nothing but the pool refers to it: every array
    made from it (the view handed out, a reshape, a slice, a memoryview, a
    tensor sharing its memory) holds a reference to it, so CPython's
    reference count says when the caller is done. Only blocks of at least
    ``min_bytes`` are pooled (small ones come from malloc's own free lists),
    at most ``keep`` per size are tracked (when all are in use, the callers
    own them and the pool forgets them), and free blocks are dropped when
    the pool holds more than ``max_bytes``. A lock makes it safe to share between
    threads (a held block can only gain references from its holder, never from the pool).
    """

    def __init__(self, min_bytes: int = 256 << 10, keep: int = 64, max_bytes: int = 2 << 30):
        # keep: a model has many gradients of one shape (ResNet-50 eleven of 1 MiB, a transformer one
        # per layer), all in use at once in a step; with keep=4 the pool forgot them every step and
        # 16 of ResNet-50's results came from fresh pages each time (a step took 33-95 ms, not ~30)
        self.min_bytes, self.keep, self.max_bytes = min_bytes, keep, max_bytes
        self._blocks: dict[int, list[np.ndarray]] = {}
        self.nbytes = 0
        self.reused = self.allocated = 0
        self._lock = threading.Lock()

    def empty(self, count: int, dtype) -> np.ndarray:
        """A new 1-D array of ``count`` elements of ``dtype`` (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(count, dtype)
        with self._lock:
            return self._take(nbytes, dtype)

    def _take(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        blocks = self._blocks.setdefault(nbytes, [])
        for i in range(len(blocks)):
            if _unused(blocks, i):
                self.reused += 1
                return _aligned(blocks[i], nbytes).view(dtype)
        if len(blocks) >= self.keep:                     # all in use: their owners keep them
            self.nbytes -= nbytes * len(blocks)
            blocks.clear()
        if self.nbytes + nbytes > self.max_bytes:
            self._drop_unused()
        blocks.append(np.empty(nbytes + ALIGN, np.uint8))
        self.nbytes += nbytes
        self.allocated += 1
        return _aligned(blocks[-1], nbytes).view(dtype)

    def _drop_unused(self) -> None:
        for size in list(self._blocks):
            blocks = self._blocks[size]
            kept = [blocks[i] for i in range(len(blocks)) if not _unused(blocks, i)]
            self.nbytes -= size * (len(blocks) - len(kept))
            self._blocks[size] = kept

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0


def _calibrate() -> int:
    probe = [np.empty(1, np.uint8)]
    return sys.getrefcount(probe[0])        # the list's slot and the call's argument


_FREE_REFS = _calibrate()


class Pieces:
    """1-D arrays of one dtype, addressed as if they lay back to back in one array.

    ``pieces[a:b]`` is the same kind of object over elements ``a..b-1`` (views, no copy), and
    ``pieces.parts(a, b)`` lists ``(position, view)`` for each array's share of ``a..b-1``,
    ``position`` counted from ``a``::

        arrays   [0 1 2] [3 4] [5 6 7 8]        parts(2, 6) -> (0, [2]) (1, [3 4]) (3, [5])
    """

    __slots__ = ("arrays", "starts", "size", "dtype")

    def __init__(self, arrays: list[np.ndarray]):
        if not arrays:
            raise ValueError("Pieces needs at least one array")
        self.arrays = arrays
        self.dtype = arrays[0].dtype
        self.starts = [0]
        for a in arrays:
            if a.dtype != self.dtype or a.ndim != 1:
                raise ValueError(f"Pieces: every array must be 1-D {self.dtype}, got {a.ndim}-D {a.dtype}")
            self.starts.append(self.starts[-1] + a.size)
        self.size = self.starts[-1]

    def parts(self, a: int, b: int) -> list[tuple[int, np.ndarray]]:
        """``(position from a, view)`` for every array's share of elements ``a..b-1``."""
        out, starts = [], self.starts
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(self.arrays) and starts[i] < b:
            lo, hi = max(a, starts[i]), min(b, starts[i + 1])
            if hi > lo:
                out.append((lo - a, self.arrays[i][lo - starts[i]:hi - starts[i]]))
            i += 1
        return out

    def __getitem__(self, index: slice) -> "Pieces":
        start, stop, _ = index.indices(self.size)
        views = [v for _, v in self.parts(start, stop)]
        return Pieces(views or [self.arrays[0][:0]])


def parts(window, a: int, b: int) -> list[tuple[int, np.ndarray]]:
    """``(position from a, view)`` covering elements ``a..b-1`` of ``window``: an array or :class:`Pieces`."""
    if isinstance(window, np.ndarray):
        return [(0, window[a:b])]
    return window.parts(a, b)


def as_flat(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Return ``(flat, copied)``: ``x`` as a contiguous 1-D array, and whether that took a copy."""
    if x.flags.c_contiguous:
        return x.reshape(-1), False
    return np.ascontiguousarray(x).reshape(-1), True


def restore(x: np.ndarray, flat: np.ndarray, copied: bool) -> None:
    """After an in-place reduction of ``as_flat(x)``: copy back if ``flat`` was a copy."""
    if copied:
        np.copyto(x, flat.reshape(x.shape))


def is_device_array(x) -> bool:
    """True if ``x`` lives on a GPU (CuPy, numba, ``__cuda_array_interface__``, TF GPU tensor)."""
    if isinstance(x, np.ndarray):
        return False
    module = type(x).__module__
    if not (hasattr(x, "__cuda_array_interface__") or module.startswith(("numba.cuda", "tensorflow"))
            or type(x).__name__ == "Typed"):
        return False
    from . import device          # imports numba.cuda: only for arrays that may be on a device
    return device.is_device_array(x)


def device_allreduce(comm, x, op, algorithm: str | None, *, inplace: bool):
    """Allreduce of device array ``x`` over communicator ``comm``; the result is on ``x``'s device."""
    from . import device
    return device.allreduce(x, op, comm=comm, algorithm=algorithm, inplace=inplace)
