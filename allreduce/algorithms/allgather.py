"""Ring allgather: of equal blocks (``allgather``) and of per-rank counts (``allgatherv``).

Every rank contributes ``block``; afterwards every rank holds all p blocks
in rank order in ``out``. Block b sits at offset ``sum(counts[:b])``.

::

        +-------> 0 ------> 1 -------+      step s = 0..p-2:
        |                            |        rank r sends block (r - s) % p to the right
        +-------- 3 <------ 2 <------+        and receives block (r - s - 1) % p from the left,
                                              straight into its place in ``out``.

    p = 4    step 0      step 1      step 2
    rank 0   sends b0    sends b3    sends b2
    rank 1   sends b1    sends b0    sends b3

Cost: (p-1) alpha + (p-1)/p N beta, with N the bytes gathered (for equal
blocks; with uneven counts the step time is set by the largest block in
flight). It is the second half of ring allreduce, on its own.

A block goes as messages of at most ``partition.MESSAGE_BYTES`` (256 KiB), two in flight each
way, as in ``reducescatter``. A block of zero elements is not sent at all: sender and receiver
both know its size, so both skip it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import partition
from ..transport.base import Transport, send_recv_messages

__all__ = ["allgather", "allgatherv"]

TAG = 12


def allgather(comm: Transport, block: np.ndarray, out: np.ndarray) -> None:
    """Gather every rank's ``block`` into ``out`` (``p * block.size`` elements, rank order)."""
    p, rank, n = comm.size, comm.rank, block.size
    out[rank * n:(rank + 1) * n] = block
    if p == 1:
        return
    send_to, recv_from = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):
        comm.mark("allgather", s)
        send, recv = (rank - s) % p, (rank - s - 1) % p
        comm.sendrecv(out[send * n:(send + 1) * n], send_to,
                      out[recv * n:(recv + 1) * n], recv_from, TAG)


def allgatherv(comm: Transport, block: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
    """Gather blocks of different sizes: rank r contributes ``counts[r]`` elements.

    Args:
        comm: the transport.
        block: this rank's contribution, 1-D with ``counts[comm.rank]`` elements.
        out: 1-D, ``sum(counts)`` elements of ``block``'s dtype; receives every block in rank order.
        counts: the element count of every rank, the same list on every rank. Zeros are allowed.
    """
    p, rank = comm.size, comm.rank
    offsets = [0] * p
    for r in range(1, p):
        offsets[r] = offsets[r - 1] + counts[r - 1]
    out[offsets[rank]:offsets[rank] + counts[rank]] = block
    send_to, recv_from = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):
        comm.mark("allgather", s)
        send, recv = (rank - s) % p, (rank - s - 1) % p
        send_recv_messages(comm,                                 # forward last step's block, get block recv
                           [out[at:at + n] for at, n in partition.messages(offsets[send], counts[send], out.itemsize)],
                           send_to, [out[at:at + n] for at, n in partition.messages(offsets[recv], counts[recv], out.itemsize)],
                           recv_from, TAG)
