"""Reduction operators and the dtypes they accept.

``Sum``, ``Average``, ``Min``, ``Max`` and ``Product`` are members of one
enum. ``Average`` is a ``Sum`` whose last step divides by the number of
ranks; the kernels fuse that divide into the final reduction (one pass over
memory, not two).

Integer ``Average`` follows NCCL's ``ncclAvg``: the wrapped integer sum,
then integer division truncated toward zero.

``bool`` reduces as logic: Sum and Max are logical or, Min and Product
logical and (what ``np.add``/``np.maximum`` and ``np.multiply``/``np.minimum``
give on bool arrays, and what MPI's ``MPI_LOR``/``MPI_LAND`` do). Average of
bools has no meaning and is refused before any communication.
"""
from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

__all__ = ["Op", "Sum", "Average", "Min", "Max", "Product", "Adasum",
           "SUPPORTED_DTYPES", "bfloat16", "check_dtype", "dtype_code", "dtype_from_code"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)


class _OpType(enum.EnumMeta):
    """Iterating ``Op`` (and ``len(Op)``) gives the element-wise reductions, the ones every
    algorithm implements; ``Op.ADASUM`` is a member (``Op(5)``, ``Op["ADASUM"]``) that
    combines whole vectors and has its own algorithm (:mod:`allreduce.algorithms.adasum`)."""

    def __iter__(cls):
        return (cls._member_map_[name] for name in cls._member_names_ if name != "ADASUM")

    def __len__(cls):
        return len(cls._member_names_) - 1


class Op(enum.IntEnum, metaclass=_OpType):
    """A reduction operator. Values are stable: they travel in metadata checks."""

    SUM = 0
    AVERAGE = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    ADASUM = 5        # not element-wise: see _OpType

    # Enum's own __hash__ is a Python function (hash of the name); every dict keyed by an op (the
    # kernel tables, the MPI op table) paid ~0.1 us for it per lookup on the small-message path.
    # Hashing as the int is also what equality already says: Op.SUM == 0.
    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f"ar.{self.name.capitalize()}"

    __str__ = __repr__


Sum, Average, Min, Max, Product, Adasum = Op.SUM, Op.AVERAGE, Op.MIN, Op.MAX, Op.PRODUCT, Op.ADASUM

#: The dtypes every algorithm accepts, in the order of their metadata code (new dtypes go at
#: the end: a code travels in metadata checks and in shm's tags). Horovod's ten and bfloat16.
SUPPORTED_DTYPES = tuple(np.dtype(d) for d in (
    np.float16, bfloat16, np.float32, np.float64,
    np.int8, np.int32, np.int64, np.uint8,
    np.uint16, np.int16, np.bool_))

_CODES = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}
_FLOATS = frozenset(SUPPORTED_DTYPES[:4])     # what Adasum combines


def dtype_code(dtype) -> int:
    """Small integer naming ``dtype`` in cross-rank metadata checks."""
    return _CODES[np.dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype:
    return SUPPORTED_DTYPES[code]


def as_op(op) -> Op:
    """Accept an ``Op`` (or its integer value); raise ``TypeError`` otherwise."""
    if isinstance(op, Op):
        return op
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool) and 0 <= int(op) < len(Op):
        return Op(int(op))
    raise TypeError(f"op must be one of ar.Sum, ar.Average, ar.Min, ar.Max, ar.Product, ar.Adasum; got {op!r}")


def check_dtype(dtype, op: Op) -> np.dtype:
    """Return ``dtype`` as a ``np.dtype`` if the library can reduce it with ``op``.

    Raises ``TypeError`` naming the dtype and the supported list otherwise
    (object, str, complex, ...), and for Average of bools, before any
    communication happens.
    """
    dt = np.dtype(dtype)
    if dt not in _CODES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        extra = " (complex numbers have no order, so Min/Max are undefined)" \
            if dt.kind == "c" and op in (Op.MIN, Op.MAX) else ""
        raise TypeError(f"unsupported dtype {dt}{extra}; supported dtypes are: {names}")
    if dt.kind == "b" and op == Op.AVERAGE:
        raise TypeError("Average of bool is undefined: use Sum or Max (logical or), "
                        "or Min or Product (logical and)")
    if op == Op.ADASUM and dt not in _FLOATS:
        raise TypeError(f"Adasum combines floating-point tensors (float16, bfloat16, float32, float64); got {dt}")
    return dt
