"""Reductions on host arrays: one entry point per primitive.

The algorithms call three functions and never look at dtypes:

    reduce_into(dst, src, op)             dst = dst (op) src
    reduce_finish_into(dst, src, op, p)   the same, and for Average also / p (fused)
    reduce_many_into(dst, srcs, op, p)    dst = (dst (op) srcs[0]) (op) srcs[1] ..., likewise finished
    reduce_push_into(dst, srcs, op, p)    the same, and every src gets the result too
    finish(buf, op, p)                    for Average: buf /= p   (when no reduction is left)

Both arguments are contiguous 1-D arrays of the same dtype and length.
Native dtypes go to the numba kernels in :mod:`.cpu` (and :mod:`.fused`, three
sources per pass); float16 and bfloat16
go to the bit-pattern kernels in :mod:`.half`. :mod:`.reference` holds the
numpy versions that the tests trust. Device arrays are dispatched in
:mod:`allreduce.buffers`, the one place that decides host versus device.
"""
from __future__ import annotations

import numpy as np

from ..ops import Average, Op, Sum, bfloat16
from . import cpu, fused, half

__all__ = ["reduce_into", "reduce_first_into", "has_first", "reduce_finish_into", "reduce_finish_into_both", "reduce_many_into",
           "reduce_push_into",
           "reduce_finish_split_into", "finish", "copy_into"]

_NATIVE = {Op.SUM: cpu.sum_into, Op.AVERAGE: cpu.sum_into, Op.PRODUCT: cpu.prod_into,
           Op.MIN: cpu.min_into, Op.MAX: cpu.max_into}
_HALF = {np.dtype(np.float16): half.FLOAT16, bfloat16: half.BFLOAT16}
_FIRST = {Op.SUM: cpu.sum_first_into, Op.AVERAGE: cpu.sum_first_into, Op.PRODUCT: cpu.prod_first_into}
_SPLIT = {Op.SUM: cpu.sum_split_into, Op.PRODUCT: cpu.prod_split_into, Op.MIN: cpu.min_split_into,
          Op.MAX: cpu.max_split_into}
# Fused kernels by op; "int": integer Sum and Average (int64 arithmetic, wrapped by the store).
_FUSED = {Op.SUM: fused.sum3_into, Op.AVERAGE: fused.sum3_into, Op.PRODUCT: fused.prod3_into,
          Op.MIN: fused.min3_into, Op.MAX: fused.max3_into, "int": fused.int_sum3_into}
_PUSH = {1: {Op.SUM: fused.sum_push, Op.AVERAGE: fused.sum_push, Op.PRODUCT: fused.prod_push,
             Op.MIN: fused.min_push, Op.MAX: fused.max_push, "int": fused.int_sum_push},
         3: {Op.SUM: fused.sum3_push, Op.AVERAGE: fused.sum3_push, Op.PRODUCT: fused.prod3_push,
             Op.MIN: fused.min3_push, Op.MAX: fused.max3_push, "int": fused.int_sum3_push}}
# _BOOL_AVERAGE: the API refuses Average of bool (ops.check_dtype). Below it, the kernels treat it
# as Sum (logical or; the fused kernels' divide leaves a nonzero sum nonzero), so an algorithm
# handed one still gives every rank the same bits, and the reference says the same.
#: reduce_push_into's fallback works through this much at a time, so the result is still in the
#: core's L2 (1 MiB per core on the development VM) when it is copied into the operands.
PUSH_CHUNK_BYTES = 256 << 10
_BOTH = {Op.SUM: cpu.sum_into_both, Op.PRODUCT: cpu.prod_into_both, Op.MIN: cpu.min_into_both,
         Op.MAX: cpu.max_into_both}
# The hot paths compare against the module names ``Sum`` and ``Average``, never ``Op.AVERAGE``: on
# Python 3.11 an enum member looked up on its class costs ~0.12 us (a descriptor), a tenth of
# a small-message swap, paid once or twice per reduction call.
# bool goes through the same kernels: numba adds and multiplies bools as integers and the store
# turns the result back into a bool (nonzero -> True), so Sum is or and Product is and.
_NATIVE_DTYPES = frozenset(np.dtype(d) for d in (np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8,
                                                 np.uint16, np.int16, np.bool_))


def reduce_into(dst: np.ndarray, src: np.ndarray, op: Op) -> None:
    """``dst = dst (op) src`` elementwise. For Average this is the plain sum."""
    if dst.size == 0:
        return
    fmt = _HALF.get(dst.dtype)
    if fmt is not None:
        code = Sum if op == Average else op
        half.reduce_half_into(dst.view(np.uint16), src.view(np.uint16), int(code), 1, *fmt.args)
    else:
        _NATIVE[op](dst, src)


def reduce_first_into(dst: np.ndarray, src: np.ndarray, op: Op) -> bool:
    """``dst = src (op) dst`` (``src`` the first operand) for Sum and Product; True if done.

    Recursive doubling needs ``lower (op) higher`` on both partners; with this
    the higher rank keeps the result in its own buffer instead of copying it
    back. Min, Max and the 16-bit formats return False (use :func:`reduce_into`).
    """
    kernel = _FIRST.get(op)
    if kernel is None or dst.dtype not in _NATIVE_DTYPES:
        return False
    if dst.size:
        kernel(dst, src)
    return True


def has_first(op: Op, dtype: np.dtype) -> bool:
    """Does :func:`reduce_first_into` do ``op`` on ``dtype`` (else it returns False, doing nothing)?"""
    return op in _FIRST and dtype in _NATIVE_DTYPES


def reduce_finish_into(dst: np.ndarray, src: np.ndarray, op: Op, nranks: int) -> None:
    """The last reduction of an element: as :func:`reduce_into`, then ``/ nranks`` for Average."""
    if op != Average:
        reduce_into(dst, src, op)
        return
    if dst.size == 0:
        return
    fmt = _HALF.get(dst.dtype)
    if fmt is not None:
        half.reduce_half_into(dst.view(np.uint16), src.view(np.uint16), int(Average), nranks, *fmt.args)
    elif dst.dtype.kind == "f":
        cpu.sum_avg_into(dst, src, nranks)
    elif dst.dtype.kind == "b":
        cpu.sum_into(dst, src)                           # bool: see _BOOL_AVERAGE
    else:
        cpu.int_sum_avg_into(dst, src, nranks)


def reduce_finish_into_both(dst: np.ndarray, src: np.ndarray, out: np.ndarray, op: Op, nranks: int) -> bool:
    """:func:`reduce_finish_into`, with the result also written to ``out``, in one pass; True if done.

    float16 and bfloat16 return False: do it in two steps (reduce, then copy).
    """
    if dst.dtype not in _NATIVE_DTYPES:
        return False
    if dst.size == 0:
        return True
    if op == Average and dst.dtype.kind != "b":         # bool: see _BOOL_AVERAGE
        (cpu.sum_avg_into_both if dst.dtype.kind == "f" else cpu.int_sum_avg_into_both)(dst, src, out, nranks)
    elif op == Average:
        cpu.sum_into_both(dst, src, out)
    else:
        _BOTH[op](dst, src, out)
    return True


def reduce_many_into(dst: np.ndarray, srcs, op: Op, nranks: int, out: np.ndarray | None = None) -> None:
    """``dst = ((dst (op) srcs[0]) (op) srcs[1]) ...``, in that order, then ``/ nranks`` for Average
    (``nranks`` 0: the plain sum); ``out``, if given, receives the result too.

    The same bits as :func:`reduce_into` per source and :func:`reduce_finish_into` for the last,
    with less memory traffic: native dtypes take three sources per pass (:mod:`.fused`), so
    ``dst`` is read and written once per three sources instead of once per source. shm's reduce
    step calls this with its slice and the p - 1 peers' copies of it.
    """
    if dst.size == 0:
        return
    op, nranks = _finishing(op, nranks)
    last, done = len(srcs), 0
    if last and dst.dtype in _NATIVE_DTYPES:
        kernel = _fused_kernel(_FUSED, dst.dtype, op)
        while last - done >= 3:
            final = done + 3 == last
            kernel(dst, srcs[done], srcs[done + 1], srcs[done + 2],
                   out if (final and out is not None) else dst, nranks if (final and op == Average) else 0)
            done += 3
        if done == last:
            return
    if last == 0:
        finish(dst, op, nranks)
    else:
        for src in srcs[done:last - 1]:
            reduce_into(dst, src, op)
        if out is not None and reduce_finish_into_both(dst, srcs[-1], out, op, nranks):
            return
        reduce_finish_into(dst, srcs[-1], op, nranks)
    if out is not None:
        copy_into(out, dst)


def reduce_push_into(dst: np.ndarray, srcs, op: Op, nranks: int) -> None:
    """:func:`reduce_many_into`, and every array of ``srcs`` receives the result too.

    shm on registered buffers: ``dst`` is my slice of my array, ``srcs`` the same slice of each
    peer's, and every rank ends with the result. One or three sources of a native dtype take
    one fused loop (:mod:`.fused`: each line read and written while it is in L1); other counts
    and the 16-bit formats reduce and copy in chunks of ``PUSH_CHUNK_BYTES``.
    """
    if dst.size == 0:
        return
    op, nranks = _finishing(op, nranks)
    table = _PUSH.get(len(srcs))
    if table is not None and dst.dtype in _NATIVE_DTYPES:
        _fused_kernel(table, dst.dtype, op)(dst, *srcs, nranks if op == Average else 0)
        return
    step = max(1, PUSH_CHUNK_BYTES // dst.itemsize)
    for lo in range(0, dst.size, step):
        mine = dst[lo:lo + step]
        theirs = [src[lo:lo + step] for src in srcs]
        reduce_many_into(mine, theirs, op, nranks)
        for other in theirs:
            copy_into(other, mine)


def _finishing(op: Op, nranks: int) -> tuple[Op, int]:
    """``(op, nranks)`` for a last reduction: Average with ``nranks`` <= 0 is the plain sum."""
    if op == Average and nranks <= 0:
        return Sum, 1
    return op, max(nranks, 1)


def _fused_kernel(table: dict, dtype: np.dtype, op: Op):
    """``table``'s kernel for ``op``; integer Sum and Average share the wrapping "int" one."""
    return table["int"] if (dtype.kind in "iu" and op in (Sum, Average)) else table[op]


def reduce_finish_split_into(dst: np.ndarray, src: np.ndarray, lo: int, hi: int, op: Op, nranks: int) -> bool:
    """The last reduction with ``dst`` the first operand on ``[lo, hi)`` and ``src`` first elsewhere,
    in one pass; True if done. float16 and bfloat16 return False (reduce the pieces one by one)."""
    kind = dst.dtype.kind
    if kind in "iub" and dst.dtype in _NATIVE_DTYPES:
        reduce_finish_into(dst, src, op, nranks)        # integer and bool ops are exactly commutative
        return True
    if dst.dtype not in _NATIVE_DTYPES:
        return False
    if dst.size:
        if op == Average:
            cpu.sum_avg_split_into(dst, src, lo, hi, nranks)
        else:
            _SPLIT[op](dst, src, lo, hi)
    return True


def finish(buf: np.ndarray, op: Op, nranks: int) -> None:
    """Apply Average's divide to an already fully reduced buffer (no-op for other ops)."""
    if op != Average or nranks == 1 or buf.size == 0:
        return
    fmt = _HALF.get(buf.dtype)
    if fmt is not None:
        half.avg_half_inplace(buf.view(np.uint16), nranks, *fmt.args)
    elif buf.dtype.kind == "f":
        cpu.avg_inplace(buf, nranks)
    elif buf.dtype.kind != "b":                          # bool: see _BOOL_AVERAGE
        cpu.int_avg_inplace(buf, nranks)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` (a memcpy; numpy already does it at memory speed)."""
    np.copyto(dst, src)
