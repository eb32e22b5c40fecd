"""Ring reduce-scatter: reduce a buffer across ranks, each rank keeping one segment.

``buf`` holds ``sum(counts)`` elements on every rank, cut into p segments
in rank order (segment r has ``counts[r]`` elements). Afterwards rank r's
``out`` holds segment r reduced over all ranks. This is the first half of
ring allreduce (``ring.py``), shifted by one so that rank r finishes with
its own segment instead of segment r + 1.

::

        +-------> 0 ------> 1 -------+      step s = 0..p-2:
        |                            |        rank r sends segment (r - s - 1) % p to the right,
        +-------- 3 <------ 2 <------+        receives segment (r - s - 2) % p from the left
                                              and reduces it into its own copy.

    p = 3, segments a b c (rank r holds a_r, b_r, c_r):
        step   rank 0 sends   rank 1 sends   rank 2 sends
        0      c_0            a_1            b_2
        1      b_0+b_2        c_0+c_1        a_1+a_2
    then rank 0 adds a_1+a_2 to a_0 -> a; rank 1 gets b; rank 2 gets c.

The last step's reduction fuses Average's divide (one pass, as in ring.py),
then the finished segment is copied to ``out``. A zero-size segment is
skipped by sender and receiver alike.

A segment goes as messages of at most ``partition.MESSAGE_BYTES`` (256 KiB), two in flight
each way (``send_recv_messages``): a whole multi-MiB segment at once crossed the 1 Gbit/s
namespace cluster at about half its rate.

Cost: (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma, n = bytes of ``buf``
(for equal segments).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import kernels, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport.base import Transport, send_recv_messages

__all__ = ["reducescatter"]

TAG = 15


def reducescatter(comm: Transport, buf: np.ndarray, out: np.ndarray, counts: Sequence[int], op: Op, *,
                  workspace: Workspace) -> None:
    """Reduce ``buf`` with ``op`` across ranks; write this rank's segment to ``out``.

    Args:
        comm: the transport.
        buf: contiguous 1-D, ``sum(counts)`` elements on every rank. Used as scratch: overwritten.
        out: contiguous 1-D, ``counts[comm.rank]`` elements of ``buf``'s dtype.
        counts: every rank's segment size, in rank order, the same on every rank. Zeros are allowed.
        op: the reduction; Average divides by ``comm.size`` in the last reduction.
        workspace: scratch buffers reused across calls.
    """
    p, rank = comm.size, comm.rank
    offsets = [0] * p
    for r in range(1, p):
        offsets[r] = offsets[r - 1] + counts[r - 1]
    if p == 1:
        kernels.copy_into(out, buf[:counts[0]])
        kernels.finish(out, op, 1)
        return
    slot = workspace.get("reducescatter.slot", max(counts), buf.dtype)
    send_to, recv_from = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):
        comm.mark("reduce-scatter", s)
        send, recv = (rank - s - 1) % p, (rank - s - 2) % p
        last = s == p - 2                                    # then recv == rank: my own segment
        incoming = slot[:counts[recv]]
        send_recv_messages(comm,                                 # the partial sum reduced last step
                           [buf[at:at + n] for at, n in partition.messages(offsets[send], counts[send], buf.itemsize)],
                           send_to, [incoming[at:at + n] for at, n in partition.messages(0, counts[recv], buf.itemsize)],
                           recv_from, TAG)
        mine = buf[offsets[recv]:offsets[recv] + counts[recv]]
        if last:
            kernels.reduce_finish_into(mine, incoming, op, p)   # the final reduction: fuse Average's / p
            kernels.copy_into(out, mine)
        else:
            kernels.reduce_into(mine, incoming, op)
