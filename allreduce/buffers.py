"""Host buffers: turning user arrays into what the algorithms want, and back.

The algorithms work on one contiguous 1-D array. This module is the
boundary that gets them one:

* :func:`as_flat` - any-shape, possibly strided numpy array -> contiguous 1-D
  array (a view when the layout allows, a copy only when it must);
* :func:`restore` - write a flat result back into the caller's array;
* :class:`Workspace` - scratch buffers kept between calls, so the hot loop
  of an algorithm never allocates after the first call of a given size;
* :func:`is_device_array` - the one place that decides host versus device.
  Device arrays go to :func:`device_allreduce` (:mod:`allreduce.device`:
  staged through pinned host memory, or CUDA IPC), everything else is host.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Workspace", "as_flat", "restore", "is_device_array", "device_allreduce"]


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
