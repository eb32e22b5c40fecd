"""Pairwise-exchange alltoall(v): every rank sends a different block to every rank.

Rank r's send buffer holds p blocks in rank order; block j goes to rank j.
Afterwards rank r's receive buffer holds p blocks in rank order; block j
came from rank j. It is a transpose of the p x p matrix of blocks whose row
r is rank r's send buffer::

    send buffers         receive buffers        p = 4, step k = 1..p-1:
    rank 0: a0 a1 a2 a3   rank 0: a0 b0 c0 d0      rank r sends block (r + k) % p to rank (r + k) % p
    rank 1: b0 b1 b2 b3   rank 1: a1 b1 c1 d1      and receives from rank (r - k) % p its block r,
    rank 2: c0 c1 c2 c3   rank 2: a2 b2 c2 d2      straight into its place in ``recv``.
    rank 3: d0 d1 d2 d3   rank 3: a3 b3 c3 d3    Step 0 is the local copy of block r.

        step   rank 0          rank 1          rank 2          rank 3
        1      a1 -> 1         b2 -> 2         c3 -> 3         d0 -> 0
        2      a2 -> 2         b3 -> 3         c0 -> 0         d1 -> 1
        3      a3 -> 3         b0 -> 0         c1 -> 1         d2 -> 2

At every step each rank sends one message and receives one, and every rank
is the target of exactly one sender, so no link or receiver is oversubscribed
(the schedule of MPICH's and NCCL's large-message alltoall). A zero-size
block is not sent at all: sender and receiver both know its size (from the
splits every rank exchanged first: ``Communicator.alltoall``), so both skip it.

Cost, with N the bytes each rank sends in total and equal blocks:

    T = (p-1) alpha + (p-1)/p N beta

No gamma term: nothing is reduced. The beta term is the least possible (every
byte that leaves a rank crosses the wire once); the (p-1) alpha is not: Bruck's
algorithm needs only ceil(log2 p) messages but sends each byte log2(p)/2 times,
the better trade for tiny blocks at large p. With uneven splits each step
lasts as long as its largest block in flight.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import kernels
from ..transport.base import Transport

__all__ = ["alltoall", "alltoallv", "offsets_of"]

TAG = 16


def offsets_of(counts: Sequence[int]) -> list[int]:
    """Start offset of each block: ``[0, c0, c0 + c1, ...]`` (``p`` entries)."""
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


def alltoallv(comm: Transport, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
              recv_counts: Sequence[int]) -> None:
    """Send ``send_counts[j]`` elements to rank j; receive ``recv_counts[j]`` elements from rank j.

    Args:
        comm: the transport.
        send: contiguous 1-D, ``sum(send_counts)`` elements, block j (for rank j) at
            ``offsets_of(send_counts)[j]``.
        send_counts: elements for each rank, in rank order. Zeros are allowed.
        recv: contiguous 1-D of ``send``'s dtype, ``sum(recv_counts)`` elements; block j
            (from rank j) lands at ``offsets_of(recv_counts)[j]``.
        recv_counts: elements from each rank; must equal what rank j sends here
            (``send_counts`` on rank j, entry ``comm.rank``): the caller checks that.
    """
    p, rank = comm.size, comm.rank
    soff, roff = offsets_of(send_counts), offsets_of(recv_counts)
    n = send_counts[rank]
    comm.mark("alltoall", 0)
    kernels.copy_into(recv[roff[rank]:roff[rank] + n], send[soff[rank]:soff[rank] + n])  # my own block
    for k in range(1, p):
        comm.mark("alltoall", k)
        send_to, recv_from = (rank + k) % p, (rank - k) % p
        requests = []
        if recv_counts[recv_from]:                           # rank r - k sends me its block r
            start = roff[recv_from]
            requests.append(comm.irecv(recv[start:start + recv_counts[recv_from]], recv_from, TAG))
        if send_counts[send_to]:                             # my block r + k goes to rank r + k
            start = soff[send_to]
            requests.append(comm.isend(send[start:start + send_counts[send_to]], send_to, TAG))
        comm.wait_all(requests)


def alltoall(comm: Transport, send: np.ndarray, recv: np.ndarray) -> None:
    """Equal blocks: ``send.size // p`` elements to each rank (``send.size`` divisible by p)."""
    block = send.size // comm.size
    counts = [block] * comm.size
    alltoallv(comm, send, counts, recv, counts)
