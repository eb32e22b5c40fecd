"""Ring allreduce: reduce-scatter, then allgather, around a ring of p ranks.

Each rank sends only to its right neighbour and receives only from its left.
The buffer is cut into p chunks (``partition.chunks``). With p = 4 and
chunks a, b, c, d held by ranks 0..3 (rank r holds a_r, b_r, ...):

::

        +-------> 0 ------> 1 -------+         send_to   = (rank + 1) % p
        |                            |         recv_from = (rank - 1) % p
        +-------- 3 <------ 2 <------+

    Reduce-scatter, step s = 0..p-2: rank r sends chunk (r - s) % p and
    receives chunk (r - s - 1) % p, which it adds into its own copy.

        step   rank 0 sends   rank 1 sends   rank 2 sends   rank 3 sends
        0      a_0            b_1            c_2            d_3
        1      d_0+d_3        a_0+a_1        b_1+b_2        c_2+c_3
        2      c_0+c_2+c_3    d_0+d_1+d_3    a_0+a_1+a_2    b_1+b_2+b_3

    After p-1 steps rank r owns the full sum of chunk (r + 1) % p.

    Allgather, step s = 0..p-2: rank r sends chunk (r + 1 - s) % p (complete)
    and receives chunk (r - s) % p straight into place: no reduction, no copy.

Pipelining. Every chunk is cut into segments of about ``segment_bytes``.
Segments are the unit of messaging, so while segment k is being reduced,
segment k+1 is already in flight into a second scratch slot, and a reduced
segment is forwarded to the right at once (NCCL's recvReduceSend) instead of
waiting for its whole chunk.

Cost (alpha = latency per message, beta = seconds per byte on the wire,
gamma = seconds per byte reduced, n = bytes):

    T = 2(p-1) alpha  +  2 (p-1)/p n beta  +  (p-1)/p n gamma

Each rank sends 2(p-1)/p n bytes, the least any allreduce can send; this is
why ring is the choice for large messages. Its 2(p-1) latency terms make it
a poor choice for small ones (see ``tree`` and ``rd``).
"""
from __future__ import annotations

import numpy as np

from .. import kernels, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport.base import Transport, wait_all

__all__ = ["allreduce", "reduce_scatter_plan", "TAG"]

TAG = 11
DEPTH = 2  # receive slots in flight: one being reduced, one arriving


def reduce_scatter_plan(count: int, itemsize: int, p: int, rank: int, segment_bytes: int):
    """``(send_chunks, recv_chunks)`` for each reduce-scatter step, as lists of segments."""
    chunks = partition.chunks(count, p)
    nseg = partition.num_segments(chunks[0][1], itemsize, segment_bytes)
    segs = [partition.segments(off, n, nseg) for off, n in chunks]
    send = [segs[(rank - s) % p] for s in range(p - 1)]
    recv = [segs[(rank - s - 1) % p] for s in range(p - 1)]
    return segs, send, recv


def allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int = 256 << 10) -> None:
    """Reduce ``buf`` (contiguous, 1-D) in place across all ranks of ``comm``."""
    p, rank = comm.size, comm.rank
    if p == 1 or buf.size == 0:
        kernels.finish(buf, op, p)
        return
    send_to, recv_from = (rank + 1) % p, (rank - 1) % p
    segs, send_plan, recv_plan = reduce_scatter_plan(buf.size, buf.itemsize, p, rank, segment_bytes)
    seg_len = max((n for chunk in segs for _, n in chunk), default=0)
    slots = workspace.get("ring.slots", DEPTH * seg_len, buf.dtype).reshape(DEPTH, seg_len) \
        if seg_len else None
    sends: list = []   # sends from chunks that the allgather will overwrite
    keep: list = []    # sends of my finished chunk, which is never overwritten

    # Reduce-scatter. Incoming segments form one stream: step 0's, then step 1's, ...
    incoming = [(s, off, n) for s in range(p - 1) for off, n in recv_plan[s]]
    comm.mark("reduce-scatter", 0)
    for off, n in send_plan[0]:                              # step 0: send my own chunk
        sends.append(comm.isend(buf[off:off + n], send_to, TAG))
    pending = [comm.irecv(slots[i][:n], recv_from, TAG)      # prime the receive pipeline
               for i, (_, _, n) in enumerate(incoming[:DEPTH])]
    last_step = -1
    for k, (s, off, n) in enumerate(incoming):
        if s != last_step:
            comm.mark("reduce-scatter", s)
            last_step = s
        slot = slots[k % DEPTH][:n]
        pending[k].wait()                                    # wait for segment k from the left
        dst = buf[off:off + n]
        if s < p - 2:
            kernels.reduce_into(dst, slot, op)               # recvReduceSend
        else:
            kernels.reduce_finish_into(dst, slot, op, p)     # recvReduceCopySend: now final
        if k + DEPTH < len(incoming):                        # slot is free again: refill it
            pending.append(comm.irecv(slots[k % DEPTH][:incoming[k + DEPTH][2]], recv_from, TAG))
        # Forward at once. In the last step this is allgather step 0, and waiting for it
        # here would deadlock: the right neighbour receives it only after its own wait below.
        (sends if s < p - 2 else keep).append(comm.isend(dst, send_to, TAG))
    wait_all(comm, sends)                                    # chunks sent may be overwritten below

    # Allgather: receive finished chunks straight into place; forward all but the last.
    for s in range(p - 1):
        comm.mark("allgather", s)
        chunk = segs[(rank - s) % p]
        recvs = [comm.irecv(buf[off:off + n], recv_from, TAG) for off, n in chunk]
        for (off, n), request in zip(chunk, recvs):
            request.wait()                                   # wait for segment from the left
            if s < p - 2:
                keep.append(comm.isend(buf[off:off + n], send_to, TAG))  # recvCopySend
    wait_all(comm, keep)
