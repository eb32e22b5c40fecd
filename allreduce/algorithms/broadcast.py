"""Broadcast: root's buffer onto every rank, in place. Two algorithms, picked by size.

Ranks are renumbered relative to the root, ``vr = (rank - root) % p``, so
the root is always vr 0 and both trees below are drawn for root 0.

Small buffers: a binomial tree (as in mpi4py's demo). vr receives from the
rank that differs in its lowest set bit, then sends to vr + mask for every
mask below that bit. p = 8::

    mask 4:   0 -> 4
    mask 2:   0 -> 2            4 -> 6
    mask 1:   0 -> 1   2 -> 3   4 -> 5   6 -> 7

    cost: ceil(log2 p) (alpha + n beta)

Large buffers: scatter, then ring allgather (van de Geijn). The buffer is
cut into p chunks (``partition.chunks``); chunk i belongs to vr i. A
binomial scatter sends each subtree only its subtree's chunks (half the
buffer, then a quarter, ...); then the ring allgather of ``ring.py``
completes every rank's copy in p - 1 steps::

    scatter, p = 4:   0 -[c2 c3]-> 2    then 0 -[c1]-> 1,  2 -[c3]-> 3
    allgather:        step s: vr sends chunk (vr - s) % p to vr + 1

    cost: (ceil(log2 p) + p - 1) alpha + 2 (p-1)/p n beta

The tree sends the whole buffer ceil(log2 p) times along its critical path;
the scatter-allgather sends it about twice, whatever p is, at the price of
p - 1 more latencies. It is faster once

    n > (p - 1) alpha / ((ceil(log2 p) - 2 (p-1)/p) beta)

which is 6, 5.6 and 7.1 times alpha/beta at p = 4, 8 and 16 (and 3 times
at p = 3; never at p = 2, where both send n once). With this project's
Python-level alpha ~ 25 us and beta ~ 0.25 ns/byte (``select.DEFAULTS``),
alpha/beta ~ 100 KB, hence ``LARGE_BYTES`` = 512 KiB and the tree at p = 2.
"""
from __future__ import annotations

import numpy as np

from .. import partition
from ..transport.base import Transport

__all__ = ["broadcast", "binomial", "scatter_allgather", "LARGE_BYTES"]

TAG = 14
LARGE_BYTES = 512 << 10  #: from this many bytes on (and p >= 3), scatter + ring allgather


def broadcast(comm: Transport, buf: np.ndarray, root: int, *, large_bytes: int = LARGE_BYTES) -> None:
    """Copy ``buf`` of rank ``root`` into ``buf`` of every rank (contiguous 1-D, same size everywhere).

    Args:
        comm: the transport.
        buf: root's data on root; overwritten with it on every other rank.
        root: the rank that holds the data, in ``[0, comm.size)``.
        large_bytes: buffers at least this large go by scatter + allgather (when p >= 3).
    """
    if comm.size == 1 or buf.size == 0:
        return
    if buf.nbytes >= large_bytes and comm.size >= 3:
        scatter_allgather(comm, buf, root)
    else:
        binomial(comm, buf, root)


def binomial(comm: Transport, buf: np.ndarray, root: int) -> None:
    """Binomial-tree broadcast of the whole buffer (the small-message algorithm)."""
    p = comm.size
    vr = (comm.rank - root) % p
    comm.mark("broadcast", 0)
    mask = 1
    while mask < p:                                          # receive once, from vr minus my lowest bit
        if vr & mask:
            comm.recv(buf, (vr - mask + root) % p, TAG)
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask:                                              # then feed every subtree below that bit
        if vr + mask < p:
            sends.append(comm.isend(buf, (vr + mask + root) % p, TAG))
        mask >>= 1
    comm.wait_all(sends)


def _span(chunks, lo: int, hi: int) -> tuple[int, int]:
    """Element range ``(offset, size)`` of chunks ``lo .. hi-1`` (contiguous by construction)."""
    hi = min(hi, len(chunks))
    start = chunks[lo][0]
    return start, chunks[hi - 1][0] + chunks[hi - 1][1] - start


def scatter_allgather(comm: Transport, buf: np.ndarray, root: int) -> None:
    """Van de Geijn broadcast: binomial scatter of p chunks, then a ring allgather."""
    p = comm.size
    vr = (comm.rank - root) % p
    chunks = partition.chunks(buf.size, p)

    # Scatter: receive my subtree's chunks [vr, vr + mask) from my parent ...
    comm.mark("scatter", 0)
    mask = 1
    while mask < p:
        if vr & mask:
            off, n = _span(chunks, vr, vr + mask)
            if n:
                comm.recv(buf[off:off + n], (vr - mask + root) % p, TAG)
            break
        mask <<= 1
    # ... and hand each child subtree [vr + mask, vr + 2 mask) its part.
    sends = []
    mask >>= 1
    while mask:
        if vr + mask < p:
            off, n = _span(chunks, vr + mask, vr + 2 * mask)
            if n:
                sends.append(comm.isend(buf[off:off + n], (vr + mask + root) % p, TAG))
        mask >>= 1
    comm.wait_all(sends)

    # Allgather around the ring of relative ranks: chunk (vr - s) goes right, in place.
    right, left = (comm.rank + 1) % p, (comm.rank - 1) % p
    for s in range(p - 1):
        comm.mark("allgather", s)
        s_off, s_n = chunks[(vr - s) % p]
        r_off, r_n = chunks[(vr - s - 1) % p]
        requests = []
        if r_n:
            requests.append(comm.irecv(buf[r_off:r_off + r_n], left, TAG))
        if s_n:
            requests.append(comm.isend(buf[s_off:s_off + s_n], right, TAG))
        comm.wait_all(requests)
