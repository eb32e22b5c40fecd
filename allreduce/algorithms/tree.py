r"""Pipelined double binary tree allreduce (NCCL 2.4): reduce up two trees, swap at the top, broadcast down.

One binary tree is latency-friendly (depth log2 p) but wastes bandwidth:
leaves only send, and the root's links carry everything. NCCL 2.4 runs two
trees at once, each over half of the buffer, built so that a rank that is
interior (receives from children) in one tree is a leaf in the other. Every
rank then sends and receives about the same amount. p = 8::

    tree 0: in-order, root 0        tree 1: tree 0 mirrored (r -> 7 - r), root 7
    carries buf[:n/2]               carries buf[n/2:]

      0                                           7
      ||                                         ||
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

The top edge (``||``: the root and its first child, the *partner*) is a
swap, not a hand-up followed by a hand-down. Plain reduce-then-broadcast
sends the partner's partial sum up, lets the root add it, and sends the
finished value back down: two dependent hops on that edge. Here both ends
send their partial sums at once, and both compute ``root (op) partner``
with the root's operand first, so the two results are bitwise equal. The
edge carries the same bytes each way as before (a partial sum up, the
root's partial instead of the final value down), and one hop is gone.

Steps, on both trees at once (nonblocking posts, distinct tags per tree):

    reduce k      (k = 0..S-1) a rank receives segment k of its half from each
                  child, adds it into its own, and sends the sum to its parent
                  (NCCL's recvReduceSend). Receives for segment k+1 are already
                  posted, so segment k+1 arrives while k is reduced.
                  The root and its partner swap their sums and both finish
                  segment k: that reduction is final, Average divides there.
    broadcast k   the root and its partner send finished segment k to their
                  other children; every other rank receives it from its
                  parent straight into place and forwards it (recvCopySend).

The phases run one after the other, as in NCCL's runTreeUpDown. Only the two
ranks at the top compute each final element, in the same operand order;
everyone else copies it: results are bitwise identical.

Cost. S = segments per half = ceil(n / (2 segment_bytes)), D = depth of the
trees (edges root to deepest leaf; ceil(log2 p) for even p, ceil(log2 (p-1))
for odd p). With one segment, the critical path for even p is H = max(D,
2D - 2) hops: the root (no other child) sends its own data to the partner at
once, the partner's subtree reduces in D - 1 hops, the partner finishes and
sends down D - 1 hops, and the partner's sum reaches the root in D. (Odd p:
the root waits one hop for rank p - 1 first; :func:`.select.terms` has the
count.) Each further segment adds a stage up and one down; in a stage the
busiest rank sends 2 segments of n/(2S) bytes, and a partner with two
children reduces 3 halves::

    T = (H + 2 (S - 1)) alpha  +  (H + 2 (S - 1))/S  n beta  +  1.5 max(1, (H + 2 (S - 1))/2)/S  n gamma

One segment (S = 1): H alpha, e.g. 2 alpha at p = 4 and 4 at p = 8, where
plain reduce-then-broadcast takes 2D (4 and 6), a latency choice. Many
segments (S >> D): about 2S alpha + 2 n beta + 1.5 n gamma, ring's bandwidth
with only log p latency before the pipeline fills.

At p = 2 both trees are the one edge between the two ranks, and each rank is
the root of one half and the partner in the other: one segment is then a
single swap of the whole buffer (:func:`_pair`), one ``exchange`` call,
which on one node goes through the transport's shared-memory mailboxes.
That is recursive doubling's one round; plain reduce-then-broadcast takes two.
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
SWAP = TAG + 6                # tree t's top edge swaps on SWAP + t, in every path
DEPTH = 2    # receive slots in flight per source: one being reduced, one arriving


class _Role(NamedTuple):
    """This rank's part in one tree: whom it talks to and which segments of its half it moves.

    ``children`` hand partial sums up and get finished segments back; for the root they leave
    out its partner. ``up`` gets this rank's partial sum and ``parent`` sends the finished
    segments (both -1 at the top). ``partner`` is the other end of the top edge (-1 if this
    rank is not at the top), and ``first`` says this rank is the root, whose partial is the
    left operand of the final reduction."""
    parent: int
    up: int
    children: tuple[int, ...]
    partner: int
    first: bool
    segs: tuple[tuple[int, int], ...]
    up_tag: int
    down_tag: int
    swap_tag: int


def _role(tree: Tree, rank: int, t: int, segs: tuple[tuple[int, int], ...], up_tag: int, down_tag: int) -> _Role:
    root = tree.root
    partner = tree.children[root][0]            # the root's first child: the deepest subtree
    swap = SWAP + t
    if rank == root:
        return _Role(-1, -1, tree.children[rank][1:], partner, True, segs, up_tag, down_tag, swap)
    if rank == partner:
        return _Role(-1, -1, tree.children[rank], root, False, segs, up_tag, down_tag, swap)
    parent = tree.parent[rank]
    return _Role(parent, parent, tree.children[rank], -1, False, segs, up_tag, down_tag, swap)


def _finish(mine: np.ndarray, theirs: np.ndarray, op: Op, p: int, first: bool) -> None:
    """The top edge's final reduction into ``mine``: ``root (op) partner`` on both ends.

    The root computes ``mine (op) theirs``; the partner ``theirs (op) mine``, with ``theirs``
    (the root's partial) first, so Min and Max pick the same zero or NaN on both ends."""
    if first:
        kernels.reduce_finish_into(mine, theirs, op, p)
    elif not kernels.reduce_finish_into_both(theirs, mine, mine, op, p):
        kernels.reduce_finish_into(theirs, mine, op, p)          # 16-bit formats: two passes
        kernels.copy_into(mine, theirs)


@lru_cache(maxsize=256)
def _roles(count: int, itemsize: int, p: int, rank: int, segment_bytes: int
           ) -> tuple[tuple[_Role, _Role], tuple[int, ...], int, int]:
    """This rank's two roles, the order to visit the trees in, the longest segment, the step count.

    Cached: a training loop repeats the same few sizes, and recomputing this
    in Python would cost more than moving a small message. The visiting order
    puts the tree where this rank has fewer children first, so its partial sums leave
    before it blocks on a child in the other tree; the broadcast visits them
    the other way round, so finished segments go down before it waits as a leaf.
    """
    halves = partition.chunks(count, 2)
    roles = []
    for t, (tree, (off, n)) in enumerate(zip(double_binary_tree(p), halves)):
        segs = partition.segments(off, n, partition.num_segments(n, itemsize, segment_bytes))
        roles.append(_role(tree, rank, t, segs, TAG + 2 * t, TAG + 2 * t + 1))
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
        workspace: where the receive slots (12 segments at most) come from.
        segment_bytes: pipeline segment size; each half is cut into pieces of about this many bytes.
    """
    p, rank = comm.size, comm.rank
    if p == 2:
        pair = _pair_plan(buf.size, buf.itemsize, rank, segment_bytes)
        if pair is not None:                  # small, two ranks: the latency path, one swap
            _pair(comm, buf, op, workspace, pair)
            return
    if p == 1 or buf.size == 0:
        kernels.finish(buf, op, p)
        return
    roles, order, seg_len, nsteps = _roles(buf.size, buf.itemsize, p, rank, segment_bytes)
    if nsteps == 1:
        scratch = workspace.get("tree.slots", 4 * seg_len, buf.dtype)
        _one_segment(comm, buf, op, scratch, _small_plan(buf.size, p, rank))
        return
    slots = workspace.get("tree.slots", 2 * 3 * DEPTH * seg_len, buf.dtype).reshape(2, 3, DEPTH, seg_len)
    # Sources per tree: the children (partial sums, on the up tag), then the partner (on the swap tag).
    sources = [[(child, role.up_tag) for child in role.children]
               + ([(role.partner, role.swap_tag)] if role.partner >= 0 else []) for role in roles]
    recvs = [[[comm.irecv(slots[t, j, k][:n], peer, tag) for k, (_, n) in enumerate(roles[t].segs[:DEPTH])]
              for j, (peer, tag) in enumerate(sources[t])] for t in range(2)]

    def consumed(t: int, j: int, k: int) -> None:            # slot k % DEPTH is free again: refill it
        segs = roles[t].segs
        if k + DEPTH < len(segs):
            peer, tag = sources[t][j]
            recvs[t][j].append(comm.irecv(slots[t, j, k % DEPTH][:segs[k + DEPTH][1]], peer, tag))

    # Reduce: recvReduceSend each segment on both trees; at the top, swap and finish.
    sends: list = []
    for k in range(nsteps):
        comm.mark("reduce", k)
        swaps = []
        for t in order:
            role = roles[t]
            if k >= len(role.segs):
                continue                                     # this half has fewer segments
            off, n = role.segs[k]
            dst = buf[off:off + n]
            for j, child in enumerate(role.children):
                recvs[t][j][k].wait()                        # segment k from child j
                kernels.reduce_into(dst, slots[t, j, k % DEPTH][:n], op)
                consumed(t, j, k)
            if role.partner >= 0:
                swaps.append((t, dst, comm.isend(dst, role.partner, role.swap_tag)))  # my half of the swap
            else:
                sends.append(comm.isend(dst, role.up, role.up_tag))                   # partial sum goes up
        for t, _, _ in swaps:                                # the other half of each swap
            recvs[t][len(roles[t].children)][k].wait()
        for t, dst, sent in swaps:                           # every receive before any send's wait:
            sent.wait()                                      # at p = 3 both swaps join the same two ranks
            j = len(roles[t].children)
            _finish(dst, slots[t, j, k % DEPTH][:dst.size], op, p, roles[t].first)
            consumed(t, j, k)
    wait_all(comm, sends)                                    # the broadcast overwrites what was sent

    # Broadcast: receive each finished segment from the parent into place, forward it down.
    downs = [[comm.irecv(buf[off:off + n], role.parent, role.down_tag) for off, n in role.segs]
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
                sends.append(comm.isend(buf[off:off + n], child, role.down_tag))  # recvCopySend
    wait_all(comm, sends)


class _Small(NamedTuple):
    """One rank's part in one tree when each half is a single segment: ``buf[off:off + n]``
    and the :class:`_Role` fields that matter with one segment."""
    off: int
    n: int
    children: tuple[int, ...]
    up: int
    parent: int
    partner: int
    first: bool
    swap_tag: int


@lru_cache(maxsize=256)
def _small_plan(count: int, p: int, rank: int) -> tuple[_Small, ...]:
    """This rank's part in each tree with a non-empty half, fewest children first."""
    plan = []
    for t, (tree, (off, n)) in enumerate(zip(double_binary_tree(p), partition.chunks(count, 2))):
        if n:
            role = _role(tree, rank, t, (), UP, DOWN)
            plan.append(_Small(off, n, role.children, role.up, role.parent, role.partner, role.first,
                               role.swap_tag))
    return tuple(sorted(plan, key=lambda part: len(part.children)))


def _one_segment(comm: Transport, buf: np.ndarray, op: Op, scratch: np.ndarray, plan: tuple[_Small, ...]) -> None:
    """The pipeline above when each half is one segment (small buffers): the same messages, all
    receives posted at once. Here the cost is per call into the transport, not per byte.

    One tag per phase is enough (UP, DOWN): no ordered pair of ranks is child and parent in both
    trees, since parents are even ranks in tree 0 and odd ones in tree 1 (the last rank of an odd p
    hangs under 0 and under p - 2). The top edges get a tag per tree: at p = 3 both are 0 -- 1."""
    p = comm.size
    comm.mark("reduce", 0)
    used, posted = 0, []
    for part in plan:                                # every receive of the reduce phase, before any wait
        peers = [(child, UP) for child in part.children] + ([(part.partner, part.swap_tag)] if part.partner >= 0 else [])
        reqs = []
        for peer, tag in peers:
            slot = scratch[used:used + part.n]
            used += part.n
            reqs.append((slot, comm.irecv(slot, peer, tag)))
        posted.append(reqs)
    flying, swaps = [], []
    for part, reqs in zip(plan, posted):             # leaf halves first: they go at once
        mine = buf[part.off:part.off + part.n]
        for slot, req in reqs[:len(part.children)]:
            req.wait()
            kernels.reduce_into(mine, slot, op)
        if part.partner >= 0:
            swaps.append((part, mine, reqs[-1], comm.isend(mine, part.partner, part.swap_tag)))
        else:
            flying.append(comm.isend(mine, part.up, UP))         # my partial sum goes up
    for _, _, (_, req), _ in swaps:                   # every receive before any send's wait (the sends
        req.wait()                                   # read `mine`): at p = 3 both swaps join 0 and 1
    for part, mine, (slot, _), sent in swaps:
        sent.wait()
        _finish(mine, slot, op, p, part.first)
    wait_all(comm, flying)                                       # the broadcast overwrites what went up

    # Broadcast: finished halves come down from the parents; the top and interior ranks forward theirs.
    comm.mark("broadcast", 0)
    for part in reversed(plan):
        mine = buf[part.off:part.off + part.n]
        if part.parent >= 0:
            comm.recv(mine, part.parent, DOWN)                   # the finished half, before forwarding
        flying.extend(comm.isend(mine, child, DOWN) for child in part.children)
    wait_all(comm, flying)


class _Pair(NamedTuple):
    """At p = 2 with one segment per half: this rank's root half ``buf[mine_lo:mine_hi]`` and the
    half ``buf[other_lo:other_hi]`` where it is the root's partner."""
    mine_lo: int
    mine_hi: int
    other_lo: int
    other_hi: int


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
    """:func:`_one_segment` at p = 2, where both trees are the top edge between the two ranks:
    each rank is the root of one half and the partner in the other, so both swaps are one::

        swap:    my whole buffer -> peer       peer's whole buffer -> slot
        finish:  my root half   = mine (op) peer's      (the root's operand first)
                 my other half  = peer's (op) mine      (the peer is that half's root)

    One ``exchange`` call (the transport's fast swap: shared-memory mailboxes on one node), and
    for the native dtypes one kernel call that finishes both halves, each in its own order.
    The plan is four cached offsets: at a few microseconds per call, building slices and role
    tables in Python would cost as much as the swap."""
    mine_lo, mine_hi, other_lo, other_hi = plan     # one unpack: a named field read is a call each
    slot = workspace.get("tree.slots", buf.size, buf.dtype)
    comm.mark("reduce", 0)
    comm.exchange(buf, slot, 1 - comm.rank, SWAP)
    if not kernels.reduce_finish_split_into(buf, slot, mine_lo, mine_hi, op, 2):   # both halves, one call
        _finish(buf[mine_lo:mine_hi], slot[mine_lo:mine_hi], op, 2, True)
        _finish(buf[other_lo:other_hi], slot[other_lo:other_hi], op, 2, False)
