"""Reduction kernels for the native dtypes, compiled with numba.

Each kernel is one loop over memory: ``dst[i] = dst[i] (op) src[i]``. The
``*_avg`` kernels fuse the final divide of ``Average`` into the last sum, so
an averaged allreduce touches each element once in its last step, not twice.

``nogil=True`` lets a thread-per-rank run (the in-process transport) reduce
on several cores at once. ``cache=True`` keeps the compiled code on disk so
only the first process ever pays the compile.

Min and Max propagate NaN exactly as ``np.minimum``/``np.maximum`` do.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["sum_into", "prod_into", "sum_first_into", "prod_first_into", "min_into", "max_into",
           "sum_avg_into", "avg_inplace", "int_sum_avg_into", "int_avg_inplace",
           "sum_into_both", "prod_into_both", "min_into_both", "max_into_both", "sum_avg_into_both",
           "int_sum_avg_into_both", "sum_split_into", "prod_split_into", "min_split_into", "max_split_into",
           "sum_avg_split_into"]


@njit(nogil=True, cache=True)
def sum_into(dst, src):
    for i in range(dst.size):
        dst[i] = dst[i] + src[i]


@njit(nogil=True, cache=True)
def prod_into(dst, src):
    for i in range(dst.size):
        dst[i] = dst[i] * src[i]


@njit(nogil=True, cache=True)
def sum_first_into(dst, src):
    """``dst = src + dst``: the operands in the other order (NaN payloads follow the first)."""
    for i in range(dst.size):
        dst[i] = src[i] + dst[i]


@njit(nogil=True, cache=True)
def prod_first_into(dst, src):
    for i in range(dst.size):
        dst[i] = src[i] * dst[i]


@njit(nogil=True, cache=True)
def min_into(dst, src):
    for i in range(dst.size):
        s = src[i]
        # `s != s` is the NaN test: a NaN on either side wins, as in np.minimum.
        if s < dst[i] or s != s:
            dst[i] = s


@njit(nogil=True, cache=True)
def max_into(dst, src):
    for i in range(dst.size):
        s = src[i]
        if s > dst[i] or s != s:
            dst[i] = s


@njit(nogil=True, cache=True)
def sum_avg_into(dst, src, n):
    """Floating point: ``dst = (dst + src) / n`` in one pass."""
    for i in range(dst.size):
        dst[i] = (dst[i] + src[i]) / n


@njit(nogil=True, cache=True)
def avg_inplace(dst, n):
    for i in range(dst.size):
        dst[i] = dst[i] / n


@njit(nogil=True, cache=True)
def int_sum_avg_into(dst, src, n):
    """Integers: wrap the sum in the dtype first, then divide truncating toward zero (as ncclAvg)."""
    for i in range(dst.size):
        dst[i] = dst[i] + src[i]
        v = np.int64(dst[i])   # widen first: abs(int8(-128)) is -128 in int8
        q = abs(v) // n
        dst[i] = q if v >= 0 else -q


@njit(nogil=True, cache=True)
def int_avg_inplace(dst, n):
    for i in range(dst.size):
        v = np.int64(dst[i])
        q = abs(v) // n
        dst[i] = q if v >= 0 else -q


# -- "both": the last reduction of a slice, written to the caller's buffer and to a second place
# (shm's shared region) in the same pass: one read of the result fewer than reduce-then-copy.

@njit(nogil=True, cache=True)
def sum_into_both(dst, src, out):
    for i in range(dst.size):
        v = dst[i] + src[i]
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def prod_into_both(dst, src, out):
    for i in range(dst.size):
        v = dst[i] * src[i]
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def min_into_both(dst, src, out):
    for i in range(dst.size):
        s = src[i]
        v = s if (s < dst[i] or s != s) else dst[i]
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def max_into_both(dst, src, out):
    for i in range(dst.size):
        s = src[i]
        v = s if (s > dst[i] or s != s) else dst[i]
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def sum_avg_into_both(dst, src, out, n):
    for i in range(dst.size):
        v = (dst[i] + src[i]) / n
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def int_sum_avg_into_both(dst, src, out, n):
    for i in range(dst.size):
        dst[i] = dst[i] + src[i]
        w = np.int64(dst[i])
        q = abs(w) // n
        dst[i] = q if w >= 0 else -q
        out[i] = dst[i]


# -- "split": ``dst = dst (op) src`` on [lo, hi) and ``dst = src (op) dst`` elsewhere, in one call.
# The double tree at p = 2 finishes two halves with opposite operand order (each half's root
# first, so both ranks agree to the bit); one call instead of two is ~0.4 us of a ~5 us allreduce.
# Floating point only: for integers every op here is exactly commutative.

@njit(nogil=True, cache=True)
def sum_split_into(dst, src, lo, hi):
    for i in range(dst.size):
        dst[i] = dst[i] + src[i] if lo <= i < hi else src[i] + dst[i]


@njit(nogil=True, cache=True)
def prod_split_into(dst, src, lo, hi):
    for i in range(dst.size):
        dst[i] = dst[i] * src[i] if lo <= i < hi else src[i] * dst[i]


@njit(nogil=True, cache=True)
def min_split_into(dst, src, lo, hi):
    for i in range(dst.size):
        a, b = (dst[i], src[i]) if lo <= i < hi else (src[i], dst[i])
        dst[i] = b if (b < a or b != b) else a          # a (min) b, as min_into with a = dst


@njit(nogil=True, cache=True)
def max_split_into(dst, src, lo, hi):
    for i in range(dst.size):
        a, b = (dst[i], src[i]) if lo <= i < hi else (src[i], dst[i])
        dst[i] = b if (b > a or b != b) else a


@njit(nogil=True, cache=True)
def sum_avg_split_into(dst, src, lo, hi, n):
    for i in range(dst.size):
        dst[i] = (dst[i] + src[i]) / n if lo <= i < hi else (src[i] + dst[i]) / n
