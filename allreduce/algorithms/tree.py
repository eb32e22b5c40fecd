r"""Pipelined double binary tree allreduce (NCCL 2.4): reduce up two trees, broadcast down.

One binary tree is latency-friendly (depth log2 p) but wastes bandwidth:
leaves only send, and the root's links carry everything. NCCL 2.4 runs two
trees at once, each over half of the buffer, built so that a rank that is
interior (receives from children) in one tree is a leaf in the other. Every
rank then sends and receives about the same amount. p = 8::

    tree 0: in-order, root 0        tree 1: tree 0 mirrored (r -> 7 - r), root 7
    carries buf[:n/2]               carries buf[n/2:]

      0                                           7
       \                                         /
        4                                       3
       / \                                    /  \
      2   6                                  1    5
     / \ / \                               / \  / \
    1  3 5  7                              0  2 4  6

    interior: 0 2 4 6   leaves: 1 3 5 7     interior: 1 3 5 7   leaves: 0 2 4 6

Tree 0 is the in-order binary tree on rank numbers: a rank's level is its
lowest set bit (odd ranks are leaves), and rank 0 is a root with one child.
For even p, tree 1 is its mirror, which swaps odd and even ranks. For odd
p both trees are built on the first p - 1 ranks, and the last rank is hung
under each root as a leaf. The construction lives in :mod:`.binary_tree`.

Steps, on both trees at once (nonblocking posts, distinct tags per tree):

    reduce k      (k = 0..S-1) a rank receives segment k of its half from each
                  child, adds it into its own, and sends the sum to its parent
                  (NCCL's recvReduceSend). Receives for segment k+1 are already
                  posted, so segment k+1 arrives while k is reduced.
                  The root's last reduction is final: Average divides there.
    broadcast k   the root sends finished segment k to its children; every
                  rank receives it from its parent straight into place and
                  forwards it (recvCopySend).

The phases run one after the other, as in NCCL's runTreeUpDown. Only the
root computes each final element, everyone else copies it: results are
bitwise identical.

Cost. S = segments per half = ceil(n / (2 segment_bytes)), D = depth of the
trees (edges root to deepest leaf; ceil(log2 p) for even p, ceil(log2 (p-1))
for odd p). In a pipeline stage the busiest rank (interior in one tree, a
leaf in the other) receives 2 segments of n/(2S) bytes and sends 2, so with
D + S - 1 stages per phase::

    T = 2 (D + S - 1) alpha  +  2 (D + S - 1)/S  n beta  +  (D + S - 1)/S  n gamma

One segment (S = 1): 2D alpha + 2D n beta + D n gamma, a latency choice.
Many segments (S >> D): about 2S alpha + 2 n beta + n gamma, ring's
bandwidth with only log p latency before the pipeline fills.

At p = 2 both trees are one edge, and each rank is the root of one half:
one segment is then two swaps (:func:`_pair`), each one ``exchange`` call,
which on one node goes through the transport's shared-memory mailboxes.
Two rounds against recursive doubling's one: a tree cannot finish in fewer
than 2D hand-offs, where rd takes log2 p.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from .. import kernels, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport.base import Transport, wait_all
from .binary_tree import Tree, double_binary_tree

__all__ = ["allreduce", "double_binary_tree", "Tree"]

TAG = 20     # tree t reduces on TAG + 2t and broadcasts on TAG + 2t + 1
UP, DOWN = TAG + 4, TAG + 5   # the one-segment path's two phases (see _one_segment)
DEPTH = 2    # receive slots in flight per child: one being reduced, one arriving


class _Role(NamedTuple):
    """This rank's part in one tree: whom it talks to and which segments of its half it moves."""
    parent: int
    children: tuple[int, ...]
    segs: tuple[tuple[int, int], ...]
    up: int      # tag of the reduce phase
    down: int    # tag of the broadcast phase


@lru_cache(maxsize=256)
def _roles(count: int, itemsize: int, p: int, rank: int, segment_bytes: int
           ) -> tuple[tuple[_Role, _Role], tuple[int, ...], int, int]:
    """This rank's two roles, the order to visit the trees in, the longest segment, the step count.

    Cached: a training loop repeats the same few sizes, and recomputing this
    in Python would cost more than moving a small message. The visiting order
    puts the tree where this rank is a leaf first, so its partial sums leave
    before it blocks on a child in the other tree; the broadcast visits them
    the other way round, so finished segments go down before it waits as a leaf.
    """
    halves = partition.chunks(count, 2)
    roles = []
    for t, (tree, (off, n)) in enumerate(zip(double_binary_tree(p), halves)):
        segs = partition.segments(off, n, partition.num_segments(n, itemsize, segment_bytes))
        roles.append(_Role(tree.parent[rank], tree.children[rank], segs, TAG + 2 * t, TAG + 2 * t + 1))
    order = tuple(sorted(range(2), key=lambda t: len(roles[t].children)))
    seg_len = max(n for role in roles for _, n in role.segs)
    return (roles[0], roles[1]), order, seg_len, max(len(role.segs) for role in roles)


def allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int = 256 << 10) -> None:
    """Reduce ``buf`` (contiguous, 1-D) in place across all ranks of ``comm``.

    Args:
        comm: the transport; every rank calls this with the same count, dtype and op.
        buf: this rank's contribution; holds the result on return.
        op: the reduction.
        workspace: where the receive slots (8 segments at most) come from.
        segment_bytes: pipeline segment size; each half is cut into pieces of about this many bytes.
    """
    p, rank = comm.size, comm.rank
    if p == 2:
        pair = _pair_plan(buf.size, buf.itemsize, rank, segment_bytes)
        if pair is not None:                  # small, two ranks: the latency path, two swaps
            _pair(comm, buf, op, workspace, pair)
            return
    if p == 1 or buf.size == 0:
        kernels.finish(buf, op, p)
        return
    roles, order, seg_len, nsteps = _roles(buf.size, buf.itemsize, p, rank, segment_bytes)
    if nsteps == 1:
        scratch = workspace.get("tree.slots", 2 * seg_len, buf.dtype)
        _one_segment(comm, buf, op, scratch, _small_plan(buf.size, p, rank))
        return
    slots = workspace.get("tree.slots", 2 * 2 * DEPTH * seg_len, buf.dtype).reshape(2, 2, DEPTH, seg_len)
    sends: list = []

    # Reduce: prime DEPTH receives per child, then recvReduceSend each segment on both trees.
    recvs = [[[comm.irecv(slots[t, j, k][:n], child, role.up) for k, (_, n) in enumerate(role.segs[:DEPTH])]
              for j, child in enumerate(role.children)] for t, role in enumerate(roles)]
    for k in range(nsteps):
        comm.mark("reduce", k)
        for t in order:
            role = roles[t]
            if k >= len(role.segs):
                continue                                     # this half has fewer segments
            off, n = role.segs[k]
            dst = buf[off:off + n]
            for j, child in enumerate(role.children):
                recvs[t][j][k].wait()                        # segment k from child j
                if role.parent < 0 and j == len(role.children) - 1:
                    kernels.reduce_finish_into(dst, slots[t, j, k % DEPTH][:n], op, p)  # root: final
                else:
                    kernels.reduce_into(dst, slots[t, j, k % DEPTH][:n], op)
                if k + DEPTH < len(role.segs):               # slot is free again: refill it
                    recvs[t][j].append(comm.irecv(slots[t, j, k % DEPTH][:role.segs[k + DEPTH][1]],
                                                  child, role.up))
            if role.parent >= 0:
                sends.append(comm.isend(dst, role.parent, role.up))   # partial sum goes up
    wait_all(comm, sends)                                    # the broadcast overwrites what was sent

    # Broadcast: receive each finished segment from the parent into place, forward it down.
    downs = [[comm.irecv(buf[off:off + n], role.parent, role.down) for off, n in role.segs]
             if role.parent >= 0 else [] for role in roles]
    for k in range(nsteps):
        comm.mark("broadcast", k)
        for t in reversed(order):                            # interior first: forward before waiting as a leaf
            role = roles[t]
            if k >= len(role.segs):
                continue
            off, n = role.segs[k]
            if role.parent >= 0:
                downs[t][k].wait()                           # final segment k from the parent
            for child in role.children:
                sends.append(comm.isend(buf[off:off + n], child, role.down))  # recvCopySend
    wait_all(comm, sends)


class _Small(NamedTuple):
    """One rank's part when each half is a single segment: ``inner`` is ``(off, n, children, parent)``
    for the tree where it has children (None if it has none), ``leaves`` one ``(off, n, parent)`` per
    tree where it is a leaf. Empty halves are left out."""
    inner: tuple[int, int, tuple[int, ...], int] | None
    leaves: tuple[tuple[int, int, int], ...]


@lru_cache(maxsize=256)
def _small_plan(count: int, p: int, rank: int) -> _Small:
    inner, leaves = None, []
    for tree, (off, n) in zip(double_binary_tree(p), partition.chunks(count, 2)):
        if n == 0:
            continue
        if tree.children[rank]:
            inner = (off, n, tree.children[rank], tree.parent[rank])
        else:
            leaves.append((off, n, tree.parent[rank]))
    return _Small(inner, tuple(leaves))


def _exchange(comm: Transport, sends: list, recvs: list, tag: int) -> list:
    """Start ``sends`` and complete ``recvs`` (lists of ``(buf, peer)``); return the sends still in
    flight. Exactly one of each is one ``sendrecv``: at p = 2 every phase is, and it costs one call
    into MPI instead of two posts and a wait."""
    if len(sends) == 1 and len(recvs) == 1:
        if comm.size == 2:          # both ranks swap with each other: the transport's fast swap
            comm.exchange(sends[0][0], recvs[0][0], sends[0][1], tag)
        else:
            comm.sendrecv(sends[0][0], sends[0][1], recvs[0][0], recvs[0][1], tag)
        return []
    posted = [comm.irecv(buf, peer, tag) for buf, peer in recvs]
    flying = [comm.isend(buf, peer, tag) for buf, peer in sends]
    wait_all(comm, posted)
    return flying


class _Pair(NamedTuple):
    """At p = 2 with one segment per half: this rank's root half ``buf[mine_lo:mine_hi]`` (the one
    it finishes) and its leaf half ``buf[leaf_lo:leaf_hi]`` (the one it hands up and gets back)."""
    mine_lo: int
    mine_hi: int
    leaf_lo: int
    leaf_hi: int


@lru_cache(maxsize=256)
def _pair_plan(count: int, itemsize: int, rank: int, segment_bytes: int) -> _Pair | None:
    """:class:`_Pair` for ``count`` elements at p = 2, or None where :func:`_pair` does not apply
    (nothing to reduce, or a half longer than one segment: the pipeline)."""
    if count == 0:
        return None
    (off0, n0), (off1, n1) = partition.chunks(count, 2)
    if max(partition.num_segments(n, itemsize, segment_bytes) for n in (n0, n1)) > 1:
        return None
    tree0, _ = double_binary_tree(2)       # tree 0 has root 0 and carries the first half
    if rank == tree0.root:
        return _Pair(off0, off0 + n0, off1, off1 + n1)
    return _Pair(off1, off1 + n1, off0, off0 + n0)


def _pair(comm: Transport, buf: np.ndarray, op: Op, workspace: Workspace, plan: _Pair) -> None:
    """:func:`_one_segment` at p = 2, where both trees are one edge between the two ranks: each
    rank is the root of one half and the leaf of the other, so each phase is one swap::

        reduce:     my leaf half  -> peer      peer's copy of my root half -> slot; mine (op)= slot
        broadcast:  my finished root half -> peer      peer's finished half -> my leaf half

    The same additions as the general path (the root adds its child's half to its own), in two
    ``exchange`` calls (the transport's fast swap: shared-memory mailboxes on one node) instead
    of the general path's lists of sends and receives. With one element, one half is empty and
    its swaps carry 0 bytes that way. The plan is four cached offsets: at a few microseconds per
    call, building slices and role tables in Python would cost as much as a swap."""
    mine_lo, mine_hi, leaf_lo, leaf_hi = plan       # one unpack: a named field read is a call each
    peer = 1 - comm.rank
    mine = buf[mine_lo:mine_hi]
    leaf = buf[leaf_lo:leaf_hi]
    slot = workspace.get("tree.slots", mine_hi - mine_lo, buf.dtype)
    comm.mark("reduce", 0)
    comm.exchange(leaf, slot, peer, UP)
    kernels.reduce_finish_into(mine, slot, op, 2)                   # root of my half: the final value
    comm.mark("broadcast", 0)
    comm.exchange(mine, leaf, peer, DOWN)


def _one_segment(comm: Transport, buf: np.ndarray, op: Op, scratch: np.ndarray, plan: _Small) -> None:
    """The pipeline above when each half is one segment (small buffers): the same messages, with
    as few calls into the transport as possible. Here the cost is per call into MPI, not per byte.

    One tag per phase is enough (UP, DOWN): no ordered pair of ranks is child and parent in both
    trees, since parents are even ranks in tree 0 and odd ones in tree 1 (the last rank of an odd p
    hangs under 0 and under p - 2)."""
    p = comm.size
    inner, leaves = plan
    # Reduce: my leaf halves go up at once, while my children's partial sums of my inner half arrive.
    comm.mark("reduce", 0)
    ups = [(buf[off:off + n], parent) for off, n, parent in leaves]
    if inner is None:
        flying = _exchange(comm, ups, [], UP)
    else:
        off, n, children, parent = inner
        mine = buf[off:off + n]
        slots = [scratch[j * n:(j + 1) * n] for j in range(len(children))]
        flying = _exchange(comm, ups, list(zip(slots, children)), UP)
        last = len(slots) - 1
        for j, slot in enumerate(slots):
            if parent < 0 and j == last:
                kernels.reduce_finish_into(mine, slot, op, p)    # root: the final value
            else:
                kernels.reduce_into(mine, slot, op)
        if parent >= 0:
            flying.append(comm.isend(mine, parent, UP))         # my partial sum goes up
    wait_all(comm, flying)                                       # the broadcast overwrites what went up

    # Broadcast: finished halves come down from the parents (into the leaf halves that went up);
    # my inner half goes on to my children.
    comm.mark("broadcast", 0)
    if inner is None:
        flying = _exchange(comm, [], ups, DOWN)
    else:
        if parent >= 0:
            comm.recv(mine, parent, DOWN)                        # the finished half, before forwarding
        flying = _exchange(comm, [(mine, child) for child in children], ups, DOWN)
    wait_all(comm, flying)
