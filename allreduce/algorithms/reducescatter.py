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

``keep_input=True`` leaves ``buf`` as it was (a caller's gradient that is not
a copy): the partial sums then live in two workspace slots of one segment
each, not in ``buf``. At step s the slot received last step, already reduced
with this rank's own elements, is sent, and the other slot receives::

    step 0   send buf[seg]            recv -> A;  A = A (op) buf[seg']
    step 1   send A                   recv -> B;  B = B (op) buf[seg'']
    step 2   send B                   recv -> A;  ...
    last     out = buf[my seg] (op) incoming, / p for Average

The same additions in the same order (each op is commutative, so ``A (op) x``
and ``x (op) A`` give the same bits): the result is bitwise the overwriting
version's, for 2 n/p bytes of scratch instead of n.

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
                  workspace: Workspace, keep_input: bool = False, offsets: Sequence[int] | None = None) -> None:
    """Reduce ``buf`` with ``op`` across ranks; write this rank's segment to ``out``.

    Args:
        comm: the transport.
        buf: contiguous 1-D, ``sum(counts)`` elements on every rank. Used as scratch: overwritten,
            unless ``keep_input``.
        out: contiguous 1-D, ``counts[comm.rank]`` elements of ``buf``'s dtype.
        counts: every rank's segment size, in rank order, the same on every rank. Zeros are allowed.
        op: the reduction; Average divides by ``comm.size`` in the last reduction.
        workspace: scratch buffers reused across calls.
        keep_input: leave ``buf`` unchanged (it is only read); partial sums go to two
            workspace slots of ``max(counts)`` elements.
        offsets: where each rank's segment starts in ``buf`` (default: end to end from 0). A
            caller that reduces its segments a block at a time (the same slice of every segment
            per call) bounds the workspace slots to a block.
    """
    p, rank = comm.size, comm.rank
    if offsets is None:
        offsets = [0] * p
        for r in range(1, p):
            offsets[r] = offsets[r - 1] + counts[r - 1]
    if p == 1:
        kernels.copy_into(out, buf[offsets[0]:offsets[0] + counts[0]])
        kernels.finish(out, op, 1)
        return
    slots = [workspace.get("reducescatter.slot", max(counts), buf.dtype)]
    if keep_input:
        slots.append(workspace.get("reducescatter.slot2", max(counts), buf.dtype))
    send_to, recv_from = (rank + 1) % p, (rank - 1) % p
    partial = None                                           # keep_input: the slot reduced last step
    for s in range(p - 1):
        comm.mark("reduce-scatter", s)
        send, recv = (rank - s - 1) % p, (rank - s - 2) % p
        last = s == p - 2                                    # then recv == rank: my own segment
        incoming = slots[s % len(slots)][:counts[recv]]
        outgoing = buf[offsets[send]:offsets[send] + counts[send]] if partial is None else partial
        send_recv_messages(comm,                                 # the partial sum reduced last step
                           [outgoing[at:at + n] for at, n in partition.messages(0, counts[send], buf.itemsize)],
                           send_to, [incoming[at:at + n] for at, n in partition.messages(0, counts[recv], buf.itemsize)],
                           recv_from, TAG)
        mine = buf[offsets[recv]:offsets[recv] + counts[recv]]
        if last and keep_input:
            kernels.copy_into(out, mine)
            kernels.reduce_finish_into(out, incoming, op, p)    # the same operands as below: the same bits
        elif last:
            kernels.reduce_finish_into(mine, incoming, op, p)   # the final reduction: fuse Average's / p
            kernels.copy_into(out, mine)
        elif keep_input:
            kernels.reduce_into(incoming, mine, op)              # my elements into the slot, sent next step
            partial = incoming
        else:
            kernels.reduce_into(mine, incoming, op)
