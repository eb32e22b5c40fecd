"""The numpy reference the kernels and algorithms are tested against.

Deliberately the obvious code: ``np.add``, ``np.minimum``... applied in the
input dtype (so integer wrap-around matches), plus a float64 version of the
whole allreduce for tolerance checks.
"""
from __future__ import annotations

import numpy as np

from ..ops import Op

__all__ = ["reduce_pair", "allreduce_reference", "tolerance"]

_UFUNC = {Op.SUM: np.add, Op.AVERAGE: np.add, Op.PRODUCT: np.multiply,
          Op.MIN: np.minimum, Op.MAX: np.maximum}


def reduce_pair(a: np.ndarray, b: np.ndarray, op: Op) -> np.ndarray:
    """``a (op) b`` in the arrays' own dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _UFUNC[op](a, b).astype(a.dtype)


def _int_average(total: np.ndarray, p: int) -> np.ndarray:
    q = np.abs(total.astype(np.int64)) // p
    return np.where(total >= 0, q, -q).astype(total.dtype)


def allreduce_reference(inputs: list[np.ndarray], op: Op) -> np.ndarray:
    """What every rank should hold. Floats are reduced in float64 and cast back at the end;
    integers are reduced in their own dtype, so wrap-around is part of the answer; bools by
    numpy's bool ufuncs (add and maximum: or; multiply and minimum: and)."""
    p = len(inputs)
    dtype = inputs[0].dtype
    if dtype.kind == "f" or dtype.name == "bfloat16":
        acc = np.stack([x.astype(np.float64) for x in inputs])
        with np.errstate(over="ignore", invalid="ignore"):
            out = _UFUNC[op].reduce(acc, axis=0)
            if op == Op.AVERAGE:
                out = out / p
            return out.astype(dtype)
    out = inputs[0].copy()
    for x in inputs[1:]:
        out = reduce_pair(out, x, op)
    return _int_average(out, p) if (op == Op.AVERAGE and dtype.kind != "b") else out


def tolerance(dtype, p: int, op: Op) -> float:
    """Relative tolerance for comparing a float result with the float64 reference."""
    if op in (Op.MIN, Op.MAX) or np.dtype(dtype).kind in "iub":
        return 0.0
    eps = float(np.finfo(dtype).eps)
    return eps * (p + 2) * (p if op == Op.PRODUCT else 1) * 2
