"""Several operands in one pass: ``dst = ((dst (op) a) (op) b) (op) c``, written to ``dst`` and
``out`` (``*3_into``), or to every operand (``*_push``, ``*3_push``: shm on registered buffers).

A rank that reduces its slice from p - 1 peers (shm, shm on registered
buffers) with the pairwise kernels of :mod:`.cpu` reads and writes its
slice once per peer: 3 (p - 1) slice-lengths of memory traffic. These
kernels take three peers per pass, so at p = 4 the slice is read once and
written once: p + 1 slice-lengths, 5 instead of 9. On the 2-core development
VM a 4 MiB float32 slice with three peers took 0.33 ms here against 0.50 ms
pairwise, and 2.8 against 4.4 ms at 16 MiB (single process, by hand).

The additions happen in the same order as three pairwise calls, each
intermediate rounded to the dtype (numba keeps float32 + float32 in
float32), so the bits are those of the pairwise path: every rank that
reduces the same data the same way still agrees bit for bit. Integer sums
and products are computed in int64 and wrapped once at the store, which is
the same value modulo 2**bits as wrapping after every step.

``n`` > 0 fuses Average's divide (floating point: ``sum / n``; integers: the
wrapped sum divided toward zero, as ``ncclAvg``); 0 leaves the plain sum.
``out`` may be ``dst`` itself (nothing to publish). Min and Max propagate NaN
as ``np.minimum``/``np.maximum`` do, one operand at a time.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["sum3_into", "int_sum3_into", "prod3_into", "min3_into", "max3_into",
           "sum_push", "int_sum_push", "prod_push", "min_push", "max_push",
           "sum3_push", "int_sum3_push", "prod3_push", "min3_push", "max3_push"]


@njit(inline="always")
def _min(v, s):
    return s if (s < v or s != s) else v                # `s != s`: a NaN wins, as in np.minimum


@njit(inline="always")
def _max(v, s):
    return s if (s > v or s != s) else v


@njit(inline="always")
def _int_avg(w, n):
    """A wrapped integer sum (widened to int64) divided toward zero, as ncclAvg."""
    q = abs(np.int64(w)) // n
    return q if w >= 0 else -q


@njit(nogil=True, cache=True)
def sum3_into(dst, a, b, c, out, n):
    """Floating point: ``((dst + a) + b) + c``, divided by ``n`` when ``n`` > 0."""
    if n > 0:
        for i in range(dst.size):
            w = (((dst[i] + a[i]) + b[i]) + c[i]) / n      # its own name: v stays in the dtype
            dst[i] = w
            out[i] = w
    else:
        for i in range(dst.size):
            v = ((dst[i] + a[i]) + b[i]) + c[i]
            dst[i] = v
            out[i] = v


@njit(nogil=True, cache=True)
def int_sum3_into(dst, a, b, c, out, n):
    """Integers: the sum wrapped in the dtype, divided toward zero by ``n`` when ``n`` > 0."""
    for i in range(dst.size):
        dst[i] = ((dst[i] + a[i]) + b[i]) + c[i]        # int64 arithmetic, wrapped by the store
        if n > 0:
            dst[i] = _int_avg(dst[i], n)
        out[i] = dst[i]


@njit(nogil=True, cache=True)
def prod3_into(dst, a, b, c, out, n):
    for i in range(dst.size):
        v = ((dst[i] * a[i]) * b[i]) * c[i]
        dst[i] = v
        out[i] = dst[i]


@njit(nogil=True, cache=True)
def min3_into(dst, a, b, c, out, n):
    for i in range(dst.size):
        v = _min(_min(_min(dst[i], a[i]), b[i]), c[i])
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def max3_into(dst, a, b, c, out, n):
    for i in range(dst.size):
        v = _max(_max(_max(dst[i], a[i]), b[i]), c[i])
        dst[i] = v
        out[i] = v


# -- push: the result goes back into every operand. shm on registered buffers reduces its slice of
# every rank's array and writes the result into all of them; in one loop each line is read and
# written while it is in L1 (16 MiB at p = 4, a 4 MiB slice: 1.3 ms against 1.7-2.1 ms for a
# reduce pass and three copies in 64 KiB-1 MiB chunks, single process, by hand). One peer
# (p = 2) and three (p = 4); other counts take reduce_many_into and copies.

@njit(nogil=True, cache=True)
def sum_push(dst, a, n):
    if n > 0:
        for i in range(dst.size):
            w = (dst[i] + a[i]) / n
            dst[i] = w
            a[i] = w
    else:
        for i in range(dst.size):
            v = dst[i] + a[i]
            dst[i] = v
            a[i] = v


@njit(nogil=True, cache=True)
def int_sum_push(dst, a, n):
    for i in range(dst.size):
        dst[i] = dst[i] + a[i]
        if n > 0:
            dst[i] = _int_avg(dst[i], n)
        a[i] = dst[i]


@njit(nogil=True, cache=True)
def prod_push(dst, a, n):
    for i in range(dst.size):
        dst[i] = dst[i] * a[i]
        a[i] = dst[i]


@njit(nogil=True, cache=True)
def min_push(dst, a, n):
    for i in range(dst.size):
        v = _min(dst[i], a[i])
        dst[i] = v
        a[i] = v


@njit(nogil=True, cache=True)
def max_push(dst, a, n):
    for i in range(dst.size):
        v = _max(dst[i], a[i])
        dst[i] = v
        a[i] = v


@njit(nogil=True, cache=True)
def sum3_push(dst, a, b, c, n):
    if n > 0:
        for i in range(dst.size):
            w = (((dst[i] + a[i]) + b[i]) + c[i]) / n
            dst[i] = w
            a[i] = w
            b[i] = w
            c[i] = w
    else:
        for i in range(dst.size):
            v = ((dst[i] + a[i]) + b[i]) + c[i]
            dst[i] = v
            a[i] = v
            b[i] = v
            c[i] = v


@njit(nogil=True, cache=True)
def int_sum3_push(dst, a, b, c, n):
    for i in range(dst.size):
        dst[i] = ((dst[i] + a[i]) + b[i]) + c[i]        # int64 arithmetic, wrapped by the store
        if n > 0:
            dst[i] = _int_avg(dst[i], n)
        a[i] = dst[i]
        b[i] = dst[i]
        c[i] = dst[i]


@njit(nogil=True, cache=True)
def prod3_push(dst, a, b, c, n):
    for i in range(dst.size):
        dst[i] = ((dst[i] * a[i]) * b[i]) * c[i]
        a[i] = dst[i]
        b[i] = dst[i]
        c[i] = dst[i]


@njit(nogil=True, cache=True)
def min3_push(dst, a, b, c, n):
    for i in range(dst.size):
        v = _min(_min(_min(dst[i], a[i]), b[i]), c[i])
        dst[i] = v
        a[i] = v
        b[i] = v
        c[i] = v


@njit(nogil=True, cache=True)
def max3_push(dst, a, b, c, n):
    for i in range(dst.size):
        v = _max(_max(_max(dst[i], a[i]), b[i]), c[i])
        dst[i] = v
        a[i] = v
        b[i] = v
        c[i] = v
