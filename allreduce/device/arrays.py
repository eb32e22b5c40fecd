"""Device arrays as the user hands them over: recognising them, and giving results back in kind.

Four kinds of array reach :func:`allreduce.device.allreduce`: CuPy arrays,
numba device arrays, anything else with ``__cuda_array_interface__`` (a
torch CUDA tensor, say) and TensorFlow GPU tensors, which travel through
DLPack into CuPy. :func:`is_device_array` recognises them all, and
:class:`_Input` turns one into a flat contiguous work array plus a function
that returns the result as the input's type, shape and device.

bfloat16 has no dtype in numba or CuPy: :class:`Typed` wraps a ``uint16``
device array with the dtype its bits really hold.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from numba import cuda

from ..errors import InvalidArgumentError
from ..kernels import cuda as dk

__all__ = ["Typed", "is_device_array"]


class Typed:
    """A device array whose elements are ``dtype`` (bfloat16 stored as ``uint16``, say)."""

    def __init__(self, array: Any, dtype):
        self.array, self.dtype = array, np.dtype(dtype)
        if self.dtype.itemsize != np.dtype(array.dtype).itemsize:
            raise InvalidArgumentError(f"Typed: {array.dtype} storage cannot hold {self.dtype}")
        self.shape, self.size = tuple(array.shape), int(np.prod(array.shape, dtype=np.int64))


def is_device_array(x: Any) -> bool:
    """True for CuPy/numba/torch CUDA arrays, simulator device arrays, ``Typed`` and TF GPU tensors."""
    if isinstance(x, Typed) or hasattr(x, "__cuda_array_interface__"):
        return True
    if dk.SIMULATED and type(x).__name__ == "FakeCUDAArray":
        return True
    return type(x).__module__.startswith("tensorflow") and "GPU" in str(getattr(x, "device", ""))


# -- the user's array, and the result in the same form ------------------------------------
class _Input:
    """A device array as the library needs it: a flat contiguous work array, and the result maker."""

    def __init__(self, x: Any):
        self.original, self.dtype = x, None
        if isinstance(x, Typed):
            self.dtype, x = x.dtype, x.array
        module = type(x).__module__
        self.kind = ("cupy" if module.startswith("cupy") else "tensorflow" if module.startswith("tensorflow")
                     else "numba" if hasattr(x, "copy_to_host") else "cai")
        if self.kind == "tensorflow":
            cp = _require_cupy("a TensorFlow GPU tensor (it travels through DLPack into CuPy)")
            import tensorflow as tf
            x = cp.from_dlpack(tf.experimental.dlpack.to_dlpack(x))
        self.array = x
        self.dtype = np.dtype(self.dtype or x.dtype)
        self.shape = tuple(x.shape)
        self.device_id = 0 if dk.SIMULATED else (
            x.device.id if self.kind in ("cupy", "tensorflow") else cuda.get_current_device().id)

    def work(self, inplace: bool):
        """``(flat, result)``: a contiguous 1-D device array to reduce in place, and a function
        returning what the caller gets back after the reduction."""
        x, size = self.array, int(np.prod(self.shape, dtype=np.int64))
        if self.kind in ("cupy", "tensorflow"):
            cp = dk._cupy()
            out = x if inplace and x.flags.c_contiguous else cp.array(x, order="C", copy=True)
            if not inplace:
                return out.reshape(-1), lambda: self._wrap(out)
            if out is x:
                return out.reshape(-1), lambda: self.original
            return out.reshape(-1), lambda: (x.__setitem__(Ellipsis, out), self.original)[1]
        nb = dk.as_numba(x)
        if not nb.is_c_contiguous():
            raise InvalidArgumentError("a non-contiguous numba/CUDA array cannot be reduced; "
                                       "pass a C-contiguous array (or a CuPy array)")
        if inplace:
            return nb.reshape(size), lambda: self.original
        out = cuda.device_array(self.shape, dtype=nb.dtype)
        out.copy_to_device(nb)
        return out.reshape(size), lambda: self._wrap(out)

    def _wrap(self, out):
        """``out`` (same shape as the input) as the input's type."""
        if self.kind == "tensorflow":
            import tensorflow as tf
            out = tf.experimental.dlpack.from_dlpack(out.toDlpack())
        elif self.kind == "cai" and type(self.array).__module__.startswith("torch"):
            import torch
            out = torch.as_tensor(out, device=self.array.device)
        return Typed(out, self.dtype) if isinstance(self.original, Typed) else out

    def context(self):
        """The input's GPU as the current device, for numba and CuPy, while reducing."""
        stack = contextlib.ExitStack()
        if not dk.SIMULATED:
            stack.enter_context(cuda.gpus[self.device_id])
            if dk._cupy() is not None:
                stack.enter_context(dk._cupy().cuda.Device(self.device_id))
        return stack


def _require_cupy(what: str):
    cp = dk._cupy()
    if cp is None:
        raise InvalidArgumentError(f"{what} needs CuPy with a working GPU: pip install cupy-cuda12x")
    return cp
