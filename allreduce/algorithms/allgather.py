"""Ring allgather of equal-sized blocks.

Every rank contributes ``block`` (n elements); afterwards every rank holds
all p blocks in rank order in ``out`` (p*n elements).

::

    step s = 0..p-2: rank r sends block (r - s) % p to the right,
                     receives block (r - s - 1) % p from the left, in place.

Cost: (p-1) alpha + (p-1)/p N beta, with N = p*n the bytes gathered.
It is the second half of ring allreduce, on its own.
"""
from __future__ import annotations

import numpy as np

from ..transport.base import Transport

__all__ = ["allgather"]

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
