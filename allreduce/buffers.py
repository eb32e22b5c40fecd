"""Host buffers: turning user arrays into what the algorithms want, and back.

The algorithms work on one contiguous 1-D array. This module is the
boundary that gets them one:

* :func:`as_flat` - any-shape, possibly strided numpy array -> contiguous 1-D
  array (a view when the layout allows, a copy only when it must);
* :func:`restore` - write a flat result back into the caller's array;
* :class:`Workspace` - scratch buffers kept between calls, so the hot loop
  of an algorithm never allocates after the first call of a given size.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Workspace", "as_flat", "restore"]


class Workspace:
    """Named scratch buffers, grown on demand and reused across calls."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, count: int, dtype) -> np.ndarray:
        """A 1-D array of ``count`` elements of ``dtype``; contents are undefined."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            # Round up to a power of two so a slowly growing size reallocates O(log n) times.
            size = 1 << max(6, (nbytes - 1).bit_length())
            buf = self._bufs[key] = np.empty(size, dtype=np.uint8)
        return buf[:nbytes].view(dtype)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()


def as_flat(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Return ``(flat, copied)``: ``x`` as a contiguous 1-D array, and whether that took a copy."""
    if x.flags.c_contiguous:
        return x.reshape(-1), False
    return np.ascontiguousarray(x).reshape(-1), True


def restore(x: np.ndarray, flat: np.ndarray, copied: bool) -> None:
    """After an in-place reduction of ``as_flat(x)``: copy back if ``flat`` was a copy."""
    if copied:
        np.copyto(x, flat.reshape(x.shape))
