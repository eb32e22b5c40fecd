"""Inputs for ``-c`` (check) and for timing, and the exact expected results.

Check inputs are small integers stored in the benchmark's dtype, chosen so
every partial result is exactly representable (|sum| <= 4p, |product| <=
2^p): whatever order an algorithm reduces in, the only correct answer is
the exact one, and every rank can compute it alone from the formula.
Average divides once at the end, so it may round; it is allowed one unit
in the last place of the dtype. Integer Average truncates toward zero (as
NCCL's ncclAvg). ``#wrong`` counts elements outside that.

Timing inputs are constant and stable under repeated in-place reduction
(0 for sum, 1 otherwise): no overflow to inf, no denormals, so the time of
iteration 20 is the time of iteration 1.
"""
from __future__ import annotations

import numpy as np

__all__ = ["counts", "make_input", "expected", "count_wrong", "timing_input"]

_PROD_VALUES = np.array([1, 2, -1, 1], dtype=np.int64)


def counts(size: int, dtype: np.dtype, collective: str, p: int) -> tuple[int, int]:
    """``(count, in_count)``: elements of the collective's size, and of this rank's input.

    For allgather and reducescatter the size is the whole buffer (nccl-tests),
    so count is rounded down to a multiple of p (at least p).
    """
    unit = p if collective in ("allgather", "reducescatter") else 1
    count = max(size // dtype.itemsize // unit, 1) * unit
    return count, count // p if collective == "allgather" else count


def _values(rank: int, count: int, dtype: np.dtype, op: str, start: int = 0) -> np.ndarray:
    """Rank ``rank``'s exact integer inputs for elements ``start .. start+count-1`` (as int64)."""
    i = np.arange(start, start + count, dtype=np.int64)
    unsigned = dtype.kind == "u"
    if op == "prod":
        v = _PROD_VALUES[(i + rank) % 4]
        return np.abs(v) if unsigned else v
    return (i * 7 + rank * 3) % 9 - (0 if unsigned else 4)


def make_input(rank: int, p: int, in_count: int, dtype: np.dtype, op: str) -> np.ndarray:
    """This rank's check input, ``in_count`` elements of ``dtype``."""
    return _values(rank, in_count, dtype, op).astype(dtype)


def _reduce(p: int, count: int, dtype: np.dtype, op: str, start: int = 0) -> np.ndarray:
    stack = np.stack([_values(r, count, dtype, op, start) for r in range(p)])
    if op in ("sum", "avg"):
        total = stack.sum(0)
    elif op == "prod":
        total = stack.prod(0)
    else:
        total = stack.min(0) if op == "min" else stack.max(0)
    if op != "avg":
        return total.astype(dtype)           # integer products wrap exactly like the dtype's own
    if dtype.kind in "iu":
        return (np.sign(total) * (np.abs(total) // p)).astype(dtype)
    return (total.astype(np.float64) / p).astype(dtype)


def expected(rank: int, p: int, count: int, dtype: np.dtype, op: str, collective: str) -> np.ndarray:
    """The exact result this rank must hold after the collective (root 0 for broadcast)."""
    if collective == "allreduce":
        return _reduce(p, count, dtype, op)
    if collective == "broadcast":
        return make_input(0, p, count, dtype, op)
    if collective == "allgather":
        return np.concatenate([make_input(r, p, count // p, dtype, op) for r in range(p)])
    part = count // p
    return _reduce(p, part, dtype, op, start=rank * part)


def count_wrong(got: np.ndarray, want: np.ndarray, op: str) -> int:
    """Elements of ``got`` that differ from ``want`` (Average of floats: by more than 1 ulp)."""
    got = np.asarray(got).reshape(-1)
    if got.shape != want.shape:
        return max(got.size, want.size)
    g, w = got.astype(np.float64), want.astype(np.float64)
    if op == "avg" and want.dtype.kind not in "iu":
        ulp = np.abs(np.spacing(want)).astype(np.float64) if want.dtype.itemsize >= 4 \
            else np.abs(np.spacing(w.astype(np.float32))) * _ulp_scale(want.dtype)
        return int(np.count_nonzero(~(np.abs(g - w) <= ulp)))
    return int(np.count_nonzero(~(g == w)))


def _ulp_scale(dtype: np.dtype) -> float:
    # float32 has 23 mantissa bits; float16 10 and bfloat16 7: their ulp is 2^13 or 2^16 times larger.
    return float(2 ** (23 - (10 if dtype == np.float16 else 7)))


def timing_input(in_count: int, dtype: np.dtype, op: str) -> np.ndarray:
    """A constant input that stays finite and normal under repeated in-place reduction."""
    return np.full(in_count, 0 if op == "sum" else 1, dtype=dtype)
