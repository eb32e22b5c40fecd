"""Hierarchical allreduce: shared memory inside each node, a ring across nodes.

Inside a node, ranks reduce through shared memory (:mod:`.shm`); only one
rank per slice talks to other nodes, so the network carries each byte once
per node instead of once per rank. N nodes of L ranks each, rank (node i,
local rank l), window cut into L slices:

::

    node 0: r0 r1        1  inside each node (shm): r0 gets its node's sum of slice 0,
    node 1: r2 r3                                   r1 its node's sum of slice 1
                         2  across nodes (ring), one ring per local rank, at once:
                              r0 <-> r2 on slice 0        r1 <-> r3 on slice 1
                         3  inside each node (shm): every rank copies both finished slices

Steps, per window of the shared segment (even nodes: every node has L ranks):

  1. node reduce-scatter: shm copy-in and reduce, without Average's divide:
     local rank l holds its node's sum of slice l.
  2. cross-node allreduce: ring over the N ranks (one per node) that share
     local rank l; the L rings run at once. Then Average's divide by the
     world size.
  3. node allgather: publish the slice, every rank copies every slice out.

Uneven nodes (say 3 ranks, 2 per node): the leaders (local rank 0) take the
whole window instead: 1, then the leader copies out its node's sum, runs
the ring among leaders, and publishes the whole window; the others copy it.

Every slice is reduced in one fixed order inside the node, and a ring gives
bitwise equal results to its members, so every rank ends up with the same bits.

Cost (n bytes, N nodes, L ranks per node, W = slot_bytes, alpha/beta of the
network; T_shm from :mod:`.shm`):

    T = T_shm(n, L)  +  2 (N-1) ceil(n/W) alpha  +  2 (N-1)/N * (n/L) beta  +  (N-1)/N * (n/L) gamma

Each rank sends 2 (N-1)/N * n/L bytes over the network: L times less than a
flat ring over all N*L ranks, the reason to be hierarchical.

Node layout (decided once per transport): ``node_size`` if given, else the
transport's ``fake_node_size`` attribute, which ``ar.init()`` sets from
``Config.fake_node_size`` (``ALLREDUCE_FAKE_NODE_SIZE``: nodes of that many
consecutive ranks, as ``ar.local_rank()`` reports), else the real layout
(MPI ``COMM_TYPE_SHARED``; all thread ranks form one node).
"""
from __future__ import annotations

import weakref

import numpy as np

from .. import kernels, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport.base import Transport
from . import ring, shm

__all__ = ["allreduce", "Layout", "layout"]

_TAG_OFFSET = 1000            # thread groups: keep group traffic off the parent's tags
_layouts: "weakref.WeakKeyDictionary[Transport, dict]" = weakref.WeakKeyDictionary()


class _Group(Transport):
    """Thread ranks ``members`` of a parent thread transport, renumbered 0..len-1."""

    def __init__(self, parent: Transport, members: list[int], name: str):
        self.parent, self.members, self.name = parent, tuple(members), name
        self.world = parent.world                  # threads share memory: shared.attach keys on it
        self.rank, self.size = self.members.index(parent.rank), len(self.members)

    def isend(self, buf, dest, tag=0):
        return self.parent.isend(buf, self.members[dest], tag + _TAG_OFFSET)

    def irecv(self, buf, source, tag=0):
        return self.parent.irecv(buf, self.members[source], tag + _TAG_OFFSET)

    def barrier(self) -> None:
        token = np.empty(0, np.uint8)
        if self.rank == 0:                          # gather a token from each, then release each
            for r in range(1, self.size):
                self.recv(token, r)
            for r in range(1, self.size):
                self.send(token, r)
        else:
            self.send(token, 0)
            self.recv(token, 0)

    def mark(self, phase: str, step: int) -> None:
        self.parent.mark(f"{self.name} {phase}", step)


class Layout:
    """How the ranks of one transport split into nodes, and the sub-transports that follow.

    Attributes:
        node: transport over the ranks of my node (local rank = ``node.rank``).
        cross: transport over my peers in other nodes (same local rank; even
            nodes), over the node leaders (uneven nodes, leaders only), or None.
        nodes: number of nodes. even: every node has the same number of ranks.
    """

    def __init__(self, node: Transport, cross: Transport | None, nodes: int, even: bool):
        self.node, self.cross, self.nodes, self.even = node, cross, nodes, even


def _node_ids(comm: Transport, node_size: int) -> list[int]:
    """The node of every rank, the same list on every rank."""
    if not node_size:
        node_size = getattr(comm, "fake_node_size", 0)   # set by ar.init() from Config.fake_node_size
    if node_size:
        return [r // node_size for r in range(comm.size)]
    if getattr(comm, "world", None) is not None:
        return [0] * comm.size                     # thread ranks share one process: one node
    from mpi4py import MPI
    local = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
    first = local.allreduce(comm.rank, op=MPI.MIN)  # a node is named by its lowest rank
    local.Free()
    return comm.comm.allgather(first)


def layout(comm: Transport, node_size: int = 0) -> Layout:
    """The :class:`Layout` of ``comm``; built once (collectively) and cached on the transport."""
    cached = _layouts.setdefault(comm, {})
    if node_size in cached:
        return cached[node_size]
    ids = _node_ids(comm, node_size)
    names = sorted(set(ids))
    mine = [r for r in range(comm.size) if ids[r] == ids[comm.rank]]
    sizes = {n: ids.count(n) for n in names}
    even = len(set(sizes.values())) == 1
    local = [ids[:r].count(ids[r]) for r in range(comm.size)]   # each rank's place in its node
    local_rank = local[comm.rank]
    if even:
        cross_members = [r for r in range(comm.size) if local[r] == local_rank]
    else:
        cross_members = [ids.index(n) for n in names] if local_rank == 0 else None
    if getattr(comm, "world", None) is not None:
        node = _Group(comm, mine, "node")
        cross = _Group(comm, cross_members, "cross") if cross_members else None
    else:
        from mpi4py import MPI
        from ..transport.mpi import MPITransport
        timeout = getattr(comm, "timeout", 30.0)
        node = MPITransport(comm.comm.Split(names.index(ids[comm.rank]), comm.rank), dup=False,
                            timeout=timeout)
        color = (local_rank if even else 0) if cross_members else MPI.UNDEFINED
        split = comm.comm.Split(color, comm.rank)
        cross = MPITransport(split, dup=False, timeout=timeout) if cross_members else None
    cached[node_size] = Layout(node, cross, len(names), even)
    return cached[node_size]


def _cross_allreduce(cross: Transport, data: np.ndarray, op: Op, p: int, workspace: Workspace,
                     segment_bytes: int) -> None:
    """Step 2: combine the node sums across nodes; Average divides by the world size ``p``."""
    ring.allreduce(cross, data, Op.SUM if op == Op.AVERAGE else op, workspace=workspace,
                   segment_bytes=segment_bytes)
    kernels.finish(data, op, p)


def allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int = 256 << 10, slot_bytes: int = shm.SLOT_BYTES, node_size: int = 0) -> None:
    """Reduce ``buf`` (contiguous, 1-D) in place: shm inside nodes, ring across them.

    Args:
        comm: an ``MPITransport`` or a ``ThreadTransport``.
        buf: this rank's input; holds the result afterwards, bitwise equal on every rank.
        op: the reduction.
        workspace: scratch for the cross-node ring.
        segment_bytes: pipeline segment of the cross-node ring.
        slot_bytes: shared-memory window per rank (see :mod:`.shm`).
        node_size: ranks per node (0: ``comm.fake_node_size``, else the real layout).
    """
    p = comm.size
    if p == 1 or buf.size == 0:
        kernels.finish(buf, op, p)
        return
    plan = layout(comm, node_size)
    if plan.nodes == 1:
        shm.allreduce(plan.node, buf, op, workspace=workspace, slot_bytes=slot_bytes)
        return
    if plan.nodes == p:                             # one rank per node: nothing to share
        _cross_allreduce(plan.cross, buf, op, p, workspace, segment_bytes)
        return
    intra = Op.SUM if op == Op.AVERAGE else op
    starts = shm.windows(buf.size, buf.itemsize, slot_bytes)
    seg = shm.attach(plan.node, slot_bytes)
    half = slot_bytes // buf.itemsize
    try:
        for k, start in enumerate(starts):
            window = buf[start:start + half]
            slices = partition.chunks(window.size, seg.size)
            base = half * seg.next_round()
            comm.mark("node reduce-scatter", k)
            shm.copy_in(seg, window, slices, base)
            mine = shm.reduce_slice(seg, window, slices, base, seg.post(), intra, 0)
            if plan.even:
                comm.mark("cross-node allreduce", k)
                _cross_allreduce(plan.cross, mine, op, p, workspace, segment_bytes)
                posted = shm.publish(seg, window, slices, base)
                comm.mark("node allgather", k)
                shm.copy_out(seg, window, slices, base, posted)
            else:
                _leaders_step(plan, seg, window, slices, base, op, p, workspace, segment_bytes)
    except BaseException as exc:
        seg.broken = seg.broken or f"{type(exc).__name__} in hierarchical allreduce"
        raise


def _leaders_step(plan: Layout, seg, window: np.ndarray, slices, base: int, op: Op, p: int,
                  workspace: Workspace, segment_bytes: int) -> None:
    """Uneven nodes: the leader gathers its node's sum, rings it with the other leaders, shares it."""
    posted = shm.publish(seg, window, slices, base)
    if seg.rank == 0:
        shm.copy_out(seg, window, slices, base, posted)       # the whole node sum, in my buffer
        _cross_allreduce(plan.cross, window, op, p, workspace, segment_bytes)
        kernels.copy_into(seg.data(0, window.dtype, window.size, base), window)
        seg.post()                                            # the finished window is in my region
    else:
        seg.wait(0, seg.post())                               # wait for the leader's finished window
        kernels.copy_into(window, seg.data(0, window.dtype, window.size, base))
