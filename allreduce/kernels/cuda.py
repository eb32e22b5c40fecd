"""Reductions on CUDA device arrays: the entry points, and the choice of numba or CuPy.

The same primitives as the host kernels in :mod:`allreduce.kernels`, for
device arrays (numba device arrays, CuPy arrays, anything with
``__cuda_array_interface__``), each launched on a stream:

    reduce_into(dst, src, op)             dst = dst (op) src
    reduce_finish_into(dst, src, op, p)   the same, and for Average also / p (fused)
    finish(buf, op, p)                    for Average: buf /= p
    encode_into / decode_into             float32/64 * scale <-> fp16/bf16 bits (compression)

This module checks the arguments and picks the kernels; they live in two
modules, one per backend:

* :mod:`.cuda_numba`: numba.cuda grid-stride kernels, bitwise equal to the
  host kernels (float16 and bfloat16 as ``uint16`` bit patterns, as :mod:`.half`).
* :mod:`.cupy_fallback`: the same kernels as CuPy ``ElementwiseKernel``\\ s in
  CUDA C, for a machine where numba cannot compile for the GPU (no libNVVM).

numba is the first choice (see :func:`backend`). bfloat16 device arrays are
``uint16`` arrays, because neither numba nor CuPy has the dtype: pass
``dtype=ar.bfloat16``. Under ``NUMBA_ENABLE_CUDASIM=1`` the numba kernels run
on the CPU, which is how the tests check them on a machine without a GPU.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..ops import Op
from . import cuda_numba, cupy_fallback
from .cuda_numba import SIMULATED, half_format
from .cupy_fallback import _cupy

__all__ = ["SIMULATED", "backend", "reduce_into", "reduce_finish_into", "finish", "copy_into",
           "encode_into", "decode_into", "half_format", "as_numba"]


@functools.lru_cache(maxsize=1)
def _numba_works() -> bool:
    try:
        if SIMULATED:
            return True
        from numba.cuda.cudadrv import nvvm
        return bool(cuda.is_available()) and nvvm.is_available()   # a driver, and a compiler
    except Exception:                              # noqa: BLE001 - a broken driver means "no"
        return False


def backend() -> str | None:
    """``"numba"``, ``"cupy"`` or None (no usable GPU): which kernels run, decided on first use."""
    if _numba_works():
        return "numba"
    return "cupy" if _cupy() is not None else None


def reduce_into(dst, src, op: Op, *, dtype=None, stream=0) -> None:
    """``dst = dst (op) src`` on the device, queued on ``stream``. For Average the plain sum.

    Args:
        dst, src: device arrays of the same length and dtype (1-D, contiguous).
        op: the reduction.
        dtype: the logical dtype, when it differs from ``dst.dtype`` (bfloat16 held as uint16).
        stream: a numba stream (default: the null stream).
    """
    _reduce(dst, src, op, 1, dtype, stream)


def reduce_finish_into(dst, src, op: Op, nranks: int, *, dtype=None, stream=0) -> None:
    """As :func:`reduce_into`; for Average also divide by ``nranks`` in the same pass."""
    _reduce(dst, src, op, nranks, dtype, stream)


def _reduce(dst, src, op: Op, nranks: int, dtype, stream) -> None:
    if dst.size == 0:
        return
    dtype = np.dtype(dtype or dst.dtype)
    kernels = cupy_fallback if backend() == "cupy" else cuda_numba
    kernels.reduce(dst, src, op, nranks, dtype, stream)


def finish(buf, op: Op, nranks: int, *, dtype=None, stream=0) -> None:
    """Apply Average's divide to a fully reduced device buffer (no-op for other ops)."""
    if op != Op.AVERAGE or nranks == 1 or buf.size == 0:
        return
    dtype = np.dtype(dtype or buf.dtype)
    kernels = cupy_fallback if backend() == "cupy" else cuda_numba
    kernels.finish(buf, nranks, dtype, stream)


def as_numba(x):
    """A numba device array viewing ``x`` (zero-copy for anything with ``__cuda_array_interface__``)."""
    if SIMULATED or hasattr(x, "copy_to_host"):
        return x
    return cuda.as_cuda_array(x)


def copy_into(dst, src, *, stream=0) -> None:
    """``dst[:] = src`` device to device, queued on ``stream``."""
    if dst.size:
        as_numba(dst).copy_to_device(as_numba(src), stream=stream)


def encode_into(dst_bits, src, scale: float, dtype, *, stream=0) -> None:
    """``dst_bits = bits(src * scale)``: float32/64 to fp16/bf16 patterns, rounded to nearest even."""
    fmt = half_format(dtype)
    if fmt is None:
        raise TypeError(f"encode_into casts to float16 or bfloat16, not {np.dtype(dtype)}")
    if src.size:
        cuda_numba.encode(dst_bits, src, scale, fmt, stream)


def decode_into(dst, src_bits, scale: float, dtype, *, stream=0) -> None:
    """``dst = value(src_bits) * scale``: fp16/bf16 patterns back to float32/64."""
    fmt = half_format(dtype)
    if fmt is None:
        raise TypeError(f"decode_into casts from float16 or bfloat16, not {np.dtype(dtype)}")
    if src_bits.size:
        cuda_numba.decode(dst, src_bits, scale, fmt, stream)
