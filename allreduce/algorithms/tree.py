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
count.) Each further segment adds a stage up and one down: a = H + 2 (S - 1)
stages. Bytes: every rank sends 2n in all (n/2 up and n down in the tree
where it is interior, n/2 up in the other), while the critical path is a
stages of one segment of one tree, n/(2S) bytes each; the larger bounds the
time (the partner reduces 3 halves)::

    T = a alpha  +  2 max(1, a/(4S)) n beta  +  1.5 max(1, a/(4S)) n gamma,   a = H + 2 (S - 1)

One segment (S = 1): H alpha, e.g. 2 alpha at p = 4 and 4 at p = 8, where
plain reduce-then-broadcast takes 2D (4 and 6), a latency choice; at p = 16
(H = 6) the path's 6 half-buffers outweigh the 2n: 3 n beta. Many segments
(S >> H): about 2S alpha + 2 n beta + 1.5 n gamma, ring's bandwidth with
only log p latency before the pipeline fills (:func:`.select.terms`).

At p = 2 both trees are the one edge between the two ranks, and each rank is
the root of one half and the partner in the other: one segment is then a
single swap of the whole buffer (:func:`.tree_small.pair`), one ``exchange`` call,
which on one node goes through the transport's shared-memory mailboxes.
That is recursive doubling's one round; plain reduce-then-broadcast takes two.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import kernels, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport.base import Transport, wait_all
from .binary_tree import TAG, Role, Tree, double_binary_tree, finish_top, role_of
from .tree_small import one_segment, pair, pair_plan, small_plan

DEPTH = 2    # receive slots in flight per source: one being reduced, one arriving

__all__ = ["allreduce", "double_binary_tree", "Tree"]
@lru_cache(maxsize=256)
def _roles(count: int, itemsize: int, p: int, rank: int, segment_bytes: int
           ) -> tuple[tuple[Role, Role], tuple[int, ...], int, int]:
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
        roles.append(role_of(tree, rank, t, segs, TAG + 2 * t, TAG + 2 * t + 1))
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
        plan = pair_plan(buf.size, buf.itemsize, rank, segment_bytes)
        if plan is not None:                  # small, two ranks: the latency path, one swap
            pair(comm, buf, op, workspace, plan)
            return
    if p == 1 or buf.size == 0:
        kernels.finish(buf, op, p)
        return
    roles, order, seg_len, nsteps = _roles(buf.size, buf.itemsize, p, rank, segment_bytes)
    if nsteps == 1:
        scratch = workspace.get("tree.slots", 4 * seg_len, buf.dtype)
        one_segment(comm, buf, op, scratch, small_plan(buf.size, p, rank))
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
            finish_top(dst, slots[t, j, k % DEPTH][:dst.size], op, p, roles[t].first)
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
