"""The double binary tree's latency paths: each half of the buffer is one segment.

:mod:`.tree` pipelines large buffers segment by segment. For small ones the cost is per call
into the transport, not per byte, so two shorter paths send the same messages with less
bookkeeping:

* :func:`one_segment`, any p: every receive of the reduce phase is posted at once, leaf halves
  go up first, the top edge swaps and finishes, then the finished halves come down;
* :func:`pair`, p = 2: both trees are the one edge between the two ranks, so the whole
  allreduce is one swap of the buffer and one finishing kernel (recursive doubling's one round).

The trees, tags and each rank's role come from :mod:`.binary_tree`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from .. import kernels, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport.base import Transport, wait_all
from .binary_tree import DOWN, SWAP, UP, double_binary_tree, finish_top, role_of

__all__ = ["Small", "small_plan", "one_segment", "Pair", "pair_plan", "pair"]


class Small(NamedTuple):
    """One rank's part in one tree when each half is a single segment: ``buf[off:off + n]``
    and the :class:`Role` fields that matter with one segment."""
    off: int
    n: int
    children: tuple[int, ...]
    up: int
    parent: int
    partner: int
    first: bool
    swap_tag: int


@lru_cache(maxsize=256)
def small_plan(count: int, p: int, rank: int) -> tuple[Small, ...]:
    """This rank's part in each tree with a non-empty half, fewest children first."""
    plan = []
    for t, (tree, (off, n)) in enumerate(zip(double_binary_tree(p), partition.chunks(count, 2))):
        if n:
            role = role_of(tree, rank, t, (), UP, DOWN)
            plan.append(Small(off, n, role.children, role.up, role.parent, role.partner, role.first,
                               role.swap_tag))
    return tuple(sorted(plan, key=lambda part: len(part.children)))


def one_segment(comm: Transport, buf: np.ndarray, op: Op, scratch: np.ndarray, plan: tuple[Small, ...]) -> None:
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
        finish_top(mine, slot, op, p, part.first)
    wait_all(comm, flying)                                       # the broadcast overwrites what went up

    # Broadcast: finished halves come down from the parents; the top and interior ranks forward theirs.
    comm.mark("broadcast", 0)
    for part in reversed(plan):
        mine = buf[part.off:part.off + part.n]
        if part.parent >= 0:
            comm.recv(mine, part.parent, DOWN)                   # the finished half, before forwarding
        flying.extend(comm.isend(mine, child, DOWN) for child in part.children)
    wait_all(comm, flying)


class Pair(NamedTuple):
    """At p = 2 with one segment per half: this rank's root half ``buf[mine_lo:mine_hi]`` and the
    half ``buf[other_lo:other_hi]`` where it is the root's partner."""
    mine_lo: int
    mine_hi: int
    other_lo: int
    other_hi: int


@lru_cache(maxsize=256)
def pair_plan(count: int, itemsize: int, rank: int, segment_bytes: int) -> Pair | None:
    """:class:`Pair` for ``count`` elements at p = 2, or None where :func:`pair` does not apply
    (nothing to reduce, or a half longer than one segment: the pipeline)."""
    if count == 0:
        return None
    (off0, n0), (off1, n1) = partition.chunks(count, 2)
    if max(partition.num_segments(n, itemsize, segment_bytes) for n in (n0, n1)) > 1:
        return None
    tree0, _ = double_binary_tree(2)       # tree 0 has root 0 and carries the first half
    if rank == tree0.root:
        return Pair(off0, off0 + n0, off1, off1 + n1)
    return Pair(off1, off1 + n1, off0, off0 + n0)


def pair(comm: Transport, buf: np.ndarray, op: Op, workspace: Workspace, plan: Pair) -> None:
    """:func:`one_segment` at p = 2, where both trees are the top edge between the two ranks:
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
        finish_top(buf[mine_lo:mine_hi], slot[mine_lo:mine_hi], op, 2, True)
        finish_top(buf[other_lo:other_hi], slot[other_lo:other_hi], op, 2, False)
