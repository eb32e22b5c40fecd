"""Shared-memory allreduce: every rank reduces its slice straight from its peers' memory.

For ranks on one machine. No messages: each rank owns a region of a shared
segment (:mod:`allreduce.transport.shared`), and ranks read each other's
regions in place. p = 3, each window cut into slices A, B, C; rank r owns
slice r; A1 = rank 1's input for slice A:

::

     1 copy-in (all but      2 reduce my slice, own buffer    3 copy-out: each rank
       my own slice)           first, peers in fixed order      copies every slice
    region 0: [ .  B0 C0 ]   rank 0: A = A0 + A1 + A2 -> region 0 slice A     A <- region 0
    region 1: [ A1 .  C1 ]   rank 1: B = B1 + B2 + B0 -> region 1 slice B     B <- region 1
    region 2: [ A2 B2 .  ]   rank 2: C = C2 + C0 + C1 -> region 2 slice C     C <- region 2

Steps, per window of at most ``slot_bytes`` bytes per rank (a large tensor
streams through the fixed segment, window after window):

  1. copy-in: copy my input, all but my slice, into my region; post.
  2. reduce: for each peer in a fixed order (me+1, me+2, ...): wait for its
     post, reduce its copy of my slice into my buffer; the last reduction
     fuses Average's divide and writes the finished slice into my region
     too, in the same pass (publish); post.
  3. copy-out: for each peer: wait for its second post, copy its finished
     slice into my buffer.

No barrier: each step waits only for the peers whose data it reads, one
flag at a time, so a fast rank runs ahead into its next window or call.

Why it is race-free. Flags are per-rank counters only their owner writes
(two posts per window). The region has two halves used by alternate windows
(also across calls). Half h is written again two windows later; by then I
have seen every peer's posts of the window in between, which each peer made
only after it finished reading half h. Only one rank reduces each slice,
always in the same order, so every rank gets the same bits.

Cost (n bytes, p ranks, W = slot_bytes, B = memory bandwidth, sync = one
flag hand-off: microseconds, a scheduler time slice when oversubscribed):

    T = 2 ceil(n/W) sync  +  traffic(p) * n / B
    traffic(p) = 2(p-1)/p    copy-in
               + (p-1+2m)/p  reduce: m passes over my slice, each reading it and writing it
                             once, with up to three peers' copies per pass (m = 1 at p = 2
                             and 4; pairwise passes would make it 3(p-1)/p)
               + 1/p         publish (written by the last pass: a separate copy would read
                             the slice again, 2/p)
               + 2(p-1)/p    copy-out
      = 4 at p = 2, 4.5 at p = 4 (bytes moved per byte of input: :func:`traffic`)

No message latency (alpha) and no message copies: MPI's point-to-point
algorithms copy each message into a shared buffer and out again. The
segment (2 x W x p bytes) is reused every window, so much of the traffic
above stays in the last-level cache. W trades syncs against cache
(:func:`allreduce.transport.shared.window_bytes`): with a core per rank a
sync costs microseconds, and W = 2 MiB keeps the segment in cache (on the
2-core development VM at -np 2, 4 and 16 MiB ran 1.3-1.6x faster than with
W = 4 MiB); with more ranks than cores a sync can cost a scheduler time
slice, and W = 4 MiB ran 1.2-2x faster than 2 MiB at -np 4.

Registered buffers (:func:`zero_copy`): when ``buf`` itself lies in shared
memory (``Communicator.shared_empty``), step 1 goes away: each rank reduces
its slice straight from its peers' buffers and writes the finished slice
into theirs (push), so step 3 goes too: ``traffic(p, registered=True)``
bytes per byte, 2 at p = 2 and 4, and no syncs between windows.
"""
from __future__ import annotations

import numpy as np

from .. import kernels, partition
from ..buffers import Pieces, Workspace, parts
from ..errors import MismatchError
from ..ops import Average, Op, Sum, dtype_code, dtype_from_code
from ..transport import shared
from ..transport.base import Transport

__all__ = ["allreduce", "allreduce_many", "SLOT_BYTES", "traffic", "attach", "copy_in", "reduce_slice", "publish",
           "copy_out", "windows", "zero_copy"]

#: The window per rank when a node runs more ranks than cores (milliseconds of work per sync);
#: with a core per rank the default is smaller: see :func:`allreduce.transport.shared.window_bytes`.
SLOT_BYTES = shared.WINDOW_BYTES_OVERSUBSCRIBED


def traffic(p: int, registered: bool = False) -> float:
    """Bytes each rank reads and writes per byte of input at ``p`` ranks (the cost model's gamma
    term, and the benchmark's %bound note): copy-in (not on a registered buffer), reduce in
    m = (p-1)//3 + (p-1)%3 passes (:func:`~allreduce.kernels.reduce_many_into`), publish and
    copy-out; on a registered buffer only the reduce and the push of my finished slice into the
    p - 1 peers' buffers ((p-1)/p writes: the chunk is read from the cache)."""
    if p < 2:
        return 0.0
    passes = (p - 1) // 3 + (p - 1) % 3
    reduce, copy = (p - 1 + 2 * passes) / p, 2 * (p - 1) / p
    return reduce + (p - 1) / p if registered else copy + reduce + 1 / p + copy


def attach(comm: Transport, slot_bytes: int) -> shared.SharedSegment:
    """The double-buffered shared segment for ``comm`` (two halves of ``slot_bytes`` per rank)."""
    return shared.attach(comm, 2 * slot_bytes)


def windows(count: int, itemsize: int, slot_bytes: int) -> range:
    """Start offsets of the windows a buffer of ``count`` elements streams through."""
    per = slot_bytes // itemsize
    if per < 1:
        raise ValueError(f"slot_bytes={slot_bytes} is smaller than one {itemsize}-byte element")
    return range(0, count, per)


def copy_in(seg: shared.SharedSegment, window, slices, base: int) -> None:
    """Step 1: my input, except my own slice, into my region at element ``base``.

    ``window`` is an array or a :class:`~allreduce.buffers.Pieces` (several arrays back to back)."""
    off, n = slices[seg.rank]
    region = seg.data(seg.rank, window.dtype, window.size, base)
    for a, b in ((0, off), (off + n, window.size)):
        for pos, part in parts(window, a, b):
            kernels.copy_into(region[a + pos:a + pos + part.size], part)


def reduce_slice(seg: shared.SharedSegment, window, slices, base: int, posted: int,
                 op: Op, finish_nranks: int, publish: bool = False) -> np.ndarray | None:
    """Step 2: reduce my slice of ``window`` in place from every peer's region; return it (None
    when ``window`` is a :class:`~allreduce.buffers.Pieces`: the slice may span several arrays).

    ``finish_nranks`` > 0 fuses Average's divide into the last reduction; 0 leaves a plain sum.
    ``publish``: the reduction also writes the finished slice into my region, in the same
    pass (one read of the slice fewer than :func:`publish` after it). Post afterwards.
    All p - 1 peers' copies go into one :func:`~allreduce.kernels.reduce_many_into` call: three
    peers per pass over my slice instead of one (at p = 4 the slice is read and written once).
    """
    p, me = seg.size, seg.rank
    off, n = slices[me]
    order = [(me + i) % p for i in range(1, p)]            # fixed order: every rank's bits agree
    for peer in order:
        seg.wait(peer, posted)                             # wait for every peer's copy-in
    theirs = [seg.data(peer, window.dtype, n, base + off) for peer in order]
    out = seg.data(me, window.dtype, n, base + off) if publish else None
    for pos, part in parts(window, off, off + n):
        kernels.reduce_many_into(part, [t[pos:pos + part.size] for t in theirs], op, finish_nranks,
                                 None if out is None else out[pos:pos + part.size])
    return window[off:off + n] if isinstance(window, np.ndarray) else None


def publish(seg: shared.SharedSegment, window: np.ndarray, slices, base: int) -> int:
    """End of step 2: my finished slice into my region, then post; returns the posted value."""
    off, n = slices[seg.rank]
    kernels.copy_into(seg.data(seg.rank, window.dtype, n, base + off), window[off:off + n])
    return seg.post()


def copy_out(seg: shared.SharedSegment, window, slices, base: int, posted: int) -> None:
    """Step 3: every peer's finished slice from its region into ``window`` (an array or Pieces)."""
    p, me = seg.size, seg.rank
    for i in range(1, p):
        peer = (me + i) % p
        off, n = slices[peer]
        seg.wait(peer, posted)                                 # wait for the peer's finished slice
        theirs = seg.data(peer, window.dtype, n, base + off)
        for pos, part in parts(window, off, off + n):
            kernels.copy_into(part, theirs[pos:pos + part.size])


def allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int = 0, slot_bytes: int | None = None, src: np.ndarray | None = None) -> None:
    """Reduce ``buf`` (contiguous, 1-D) in place across all ranks of ``comm`` through shared memory.

    Args:
        comm: an ``MPITransport`` whose ranks share one node, or a ``ThreadTransport``.
        buf: this rank's input; holds the result afterwards, bitwise equal on every rank.
        op: the reduction.
        workspace: unused (the shared segment is the scratch space).
        segment_bytes: unused: there are no messages to pipeline.
        slot_bytes: window size per rank; a larger buffer streams through it. None: the node's
            default, :func:`allreduce.transport.shared.window_bytes` (the same on every rank).
        src: out of place: read the input from ``src`` (same size and dtype, contiguous;
            left unchanged) instead of ``buf``. Copy-in reads it anyway, so only my own slice
            is copied into ``buf``, not the whole input (2/p instead of 2 bytes per byte).

    A ``buf`` from ``Communicator.shared_empty`` (a registered buffer: its memory is already
    shared) is reduced in place with :func:`zero_copy`, which skips step 1's copy.

    Raises:
        ValueError: the transport has no shared memory or spans several nodes.
        MismatchError: ranks passed registered buffers that do not match (another offset,
            count or dtype), or one rank a registered buffer and another not.
    """
    if src is None:
        registered = shared.find(comm, buf)
        if registered is not None and registered[1] % buf.dtype.itemsize == 0:
            zero_copy(comm, registered[0], buf, registered[1] // buf.dtype.itemsize, op, slot_bytes)
            return
    _stream(comm, buf, src, op, slot_bytes)


def zero_copy(comm: Transport, seg: shared.SharedSegment, buf: np.ndarray, offset: int, op: Op,
              slot_bytes: int | None = None) -> None:
    """Reduce ``buf`` in place where it lies: element ``offset`` of this rank's region of ``seg``
    (``comm`` only hears one mark: ``allreduce-explain shm-reg`` prints the inputs and results).

    Every rank's buffer is already in shared memory, so there is no copy-in, and the rank that
    reduces a slice can also write the result into every peer's buffer (push), instead of each
    peer copying it out (pull)::

        post "my input is ready"; check every peer's tag (offset, count, dtype) against mine
        for each window of p x slot_bytes (my part of it: its slice me), in one pass
        (kernels.reduce_push_into):
            reduce: my slice += each peer's slice, read in its buffer
            push:   the result into each peer's buffer (each line still in my cache)
        post "done writing"; wait until every peer is done writing (into mine, too: then the
        caller may read and write buf again)

        rank 0 (slice A)          buffers after the push
        A0 <- A0 + A1 + A2        0: [A  .  . ]    every rank writes only its own slice,
        A1 <- A                   1: [A  .  . ]    in every buffer; no other rank reads
        A2 <- A                   2: [A  .  . ]    or writes that slice during the call

    Bytes moved per byte (:func:`traffic`): reduce (p - 1 + 2m)/p (m passes, three peers per
    pass), push (p - 1)/p writes: 2 at p = 2 and 4, the least any allreduce can move (read the
    input, write the result), against 4.5 with the copy-in. Syncs: one all-to-all round
    before and one after, none per window. The bits are those of the copy-in path with p x
    ``slot_bytes`` (the same cut into slices, the same order of additions).

    Why it is race-free. Slice j of every buffer belongs to rank j for the whole call: only rank
    j reads it (after every rank's "ready" post: the inputs are all written) and writes it. No
    rank returns before every rank's "done" post, so no caller touches its buffer while a peer
    still reads or writes it.
    """
    p, me, count = seg.size, seg.rank, buf.size
    if p == 1 or count == 0:
        kernels.finish(buf, op, p)
        return
    tag = (offset, count, dtype_code(buf.dtype) * 64 + int(op))
    seg.set_tag(*tag)
    # One step for the explain tool, marked before my first post: after it, peers write into my
    # buffer while I work, so the only states every run shows alike are the inputs and the results.
    comm.mark("reduce+push", 0)
    ready = seg.post()
    for i in range(1, p):                                   # every rank checks every peer: all raise
        peer = (me + i) % p
        seg.wait(peer, ready)
        theirs = seg.tag(peer)
        if theirs != tag:
            seg.broken = f"registered buffers differ between rank {me} and rank {peer}"
            raise MismatchError(
                f"rank {me}: allreduce on registered buffers that differ across ranks: rank {me} "
                f"reduces {count} elements at element {offset} ({_describe(tag)}), rank {peer} "
                f"{theirs[1]} at element {theirs[0]} ({_describe(theirs)}); every rank must pass "
                "the same slice of the array shared_empty returned, with the same dtype and op")
    others = [seg.data((me + i) % p, buf.dtype, count, offset) for i in range(1, p)]   # fixed order
    slot_bytes = shared.window_bytes(p) if slot_bytes is None else slot_bytes
    per = p * (slot_bytes // buf.itemsize)                  # elements per window (windows() checks > 0)
    for start in windows(count, buf.itemsize, p * slot_bytes):
        off, n = partition.chunks(min(per, count - start), p)[me]
        lo, hi = start + off, start + off + n
        # reduce my slice from every array, and push the result into every array
        kernels.reduce_push_into(buf[lo:hi], [other[lo:hi] for other in others], op, p)
    done = seg.post()
    for i in range(1, p):
        seg.wait((me + i) % p, done)


def _describe(tag: tuple[int, ...]) -> str:
    code, op = divmod(tag[2], 64)
    try:
        return f"{dtype_from_code(code).name}, {Op(op)!r}"
    except (IndexError, KeyError, ValueError):
        return f"dtype code {code}, op {op}"


def allreduce_many(comm: Transport, bufs: list[np.ndarray], op: Op, *, srcs: list | None = None,
                   slot_bytes: int | None = None) -> None:
    """:func:`allreduce` of several arrays of one dtype as if they lay back to back in one.

    The windows run across the arrays' boundaries, so k arrays cost the syncs of one buffer of
    their total size, not of k calls (the engine's large gradients: 29 separate calls took 1.3x
    one call on the same bytes, -np 2, by hand), and nothing is copied into a joint buffer.

    Args:
        comm, op, slot_bytes: as for :func:`allreduce`.
        bufs: contiguous 1-D arrays of one dtype; each holds its result afterwards.
        srcs: out of place: ``srcs[i]`` (``bufs[i]``'s size, or None: in place) holds the input.
    """
    if srcs is not None and any(s is not None for s in srcs):
        srcs = [b if s is None else s for b, s in zip(bufs, srcs)]
        for i, (b, s) in enumerate(zip(bufs, srcs)):
            if s.size != b.size:
                raise ValueError(f"allreduce_many: srcs[{i}] has {s.size} elements, bufs[{i}] {b.size}")
        source = Pieces(srcs)
    else:
        source = None
    _stream(comm, Pieces(bufs), source, op, slot_bytes)


def _stream(comm: Transport, buf, src, op: Op, slot_bytes: int | None) -> None:
    """The three steps, window after window, over ``buf`` (an array or Pieces)."""
    p = comm.size
    if slot_bytes is None:
        slot_bytes = shared.window_bytes(p)
    if p == 1 or buf.size == 0:
        source = buf if src is None else src
        for (_, out), (_, inp) in zip(parts(buf, 0, buf.size), parts(source, 0, buf.size)):
            if out is not inp:
                kernels.copy_into(out, inp)
            kernels.finish(out, op, p)
        return
    itemsize = buf.dtype.itemsize
    starts = windows(buf.size, itemsize, slot_bytes)
    seg = attach(comm, slot_bytes)
    half = slot_bytes // itemsize
    try:
        for k, start in enumerate(starts):
            window = buf[start:start + half]
            slices = partition.chunks(window.size, p)
            base = half * seg.next_round()                     # alternate halves: see "race-free" above
            comm.mark("copy-in", k)
            if src is None:
                copy_in(seg, window, slices, base)
            else:
                source = src[start:start + half]
                copy_in(seg, source, slices, base)
                off, n = slices[comm.rank]
                for (_, out), (_, inp) in zip(parts(window, off, off + n), parts(source, off, off + n)):
                    kernels.copy_into(out, inp)
            posted = seg.post()
            comm.mark("reduce", k)
            reduce_slice(seg, window, slices, base, posted, op, p, publish=True)
            posted = seg.post()
            comm.mark("copy-out", k)
            copy_out(seg, window, slices, base, posted)
    except BaseException as exc:
        seg.broken = seg.broken or f"{type(exc).__name__} in shm allreduce"
        raise
