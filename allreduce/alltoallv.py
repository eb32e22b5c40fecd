"""The boundary of ``Communicator.alltoall``: check the splits, exchange them, run the algorithm.

Every rank must learn how many rows each peer sends it before any data
moves (the receive buffer's size and each block's offset). One allgather of
a small row of integers per rank gives that, and also lets every rank check
every rank's call: a bad ``splits`` on rank 2 (wrong length, a negative
entry, a sum that is not the tensor's first dimension) or a dtype / row
shape that differs raises the same error on every rank, naming rank 2,
instead of leaving its peers waiting for blocks that never come.

Row layout (int64): ``[problem, detail, dtype, ndim, row elements, dim 0,
splits[0..p-1]]``, where ``problem`` is 0 when this rank's arguments are
fine and ``detail`` carries the offending number for the message.
"""
from __future__ import annotations

import numpy as np

from .algorithms.allgather import allgather as _allgather_blocks
from .algorithms.alltoall import alltoallv
from .errors import InvalidArgumentError, MismatchError
from .ops import Op, check_dtype, dtype_code

__all__ = ["alltoall"]

_PROBLEMS = {
    1: "splits has {detail} entries; it needs one per rank ({p})",
    2: "splits[{detail}] is negative",
    3: "splits sums to {detail}, not to the tensor's first dimension ({dim0})",
    4: "splits must be a 1-D sequence of integers",
    5: "the tensor has no dimensions; alltoall splits its first dimension",
    6: "the tensor's dtype is not supported",
    7: "without splits the first dimension ({dim0}) must be divisible by the number of ranks ({p})",
}
_HEAD = 6       # fields before the splits


def _my_row(x: np.ndarray, splits, p: int) -> np.ndarray:
    """This rank's row of the table: its arguments, or the number of the problem with them."""
    row = np.zeros(_HEAD + p, np.int64)
    dim0 = x.shape[0] if x.ndim else 0
    row[2:6] = (-1, x.ndim, int(np.prod(x.shape[1:], dtype=np.int64)), dim0)
    try:
        row[2] = dtype_code(check_dtype(x.dtype, Op.SUM))
    except TypeError:
        row[:2] = (6, 0)
        return row
    if x.ndim == 0:
        row[:2] = (5, 0)
        return row
    s = None if splits is None else np.asarray(splits)
    if s is None or s.size == 0:                       # Horovod: no (or empty) splits = equal blocks
        if dim0 % p:
            row[:2] = (7, 0)
        else:
            row[_HEAD:] = dim0 // p
        return row
    if s.ndim != 1 or s.dtype.kind not in "iu":
        row[:2] = (4, 0)
    elif s.size != p:
        row[:2] = (1, s.size)
    elif (s < 0).any():
        row[:2] = (2, int(np.flatnonzero(s < 0)[0]))
    elif int(s.sum()) != dim0:
        row[:2] = (3, int(s.sum()))
    else:
        row[_HEAD:] = s
    return row


def _check(table: np.ndarray, p: int) -> None:
    """Raise, on every rank alike, for the first rank whose row reports a problem or disagrees."""
    for r in range(p):
        problem, detail, _, _, _, dim0 = (int(v) for v in table[r, :_HEAD])
        if problem:
            raise InvalidArgumentError(f"alltoall on rank {r}: "
                                       + _PROBLEMS[problem].format(detail=detail, p=p, dim0=dim0))
    for j, field in ((2, "dtype"), (3, "ndim"), (4, "elements per row (shape[1:])")):
        column = table[:, j]
        if (column != column[0]).any():
            values = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
            raise MismatchError(f"alltoall: {field} differs across ranks ({values}). Every rank must "
                                "send rows of the same shape and dtype.")


def alltoall(comm, x, splits=None) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``splits[j]`` of ``x`` to rank j; see :meth:`Communicator.alltoall`."""
    x = np.asarray(x)
    x = np.ascontiguousarray(x) if x.ndim else x           # (ascontiguousarray makes a scalar 1-D)
    p, rank = comm.size, comm.rank
    comm.check_agreement("alltoall")                   # same collective everywhere? (rows may differ)
    mine = _my_row(x, splits, p)
    table = np.empty(p * mine.size, np.int64)
    _allgather_blocks(comm.transport, mine, table)
    table = table.reshape(p, mine.size)
    _check(table, p)
    row = int(table[rank, 4])
    send_rows = table[rank, _HEAD:]
    recv_rows = table[:, _HEAD + rank].copy()          # rank j sends me its splits[rank] rows
    out = np.empty((int(recv_rows.sum()),) + x.shape[1:], x.dtype)
    alltoallv(comm.transport, x.reshape(-1), [int(n) * row for n in send_rows],
              out.reshape(-1), [int(n) * row for n in recv_rows])
    return out, recv_rows
