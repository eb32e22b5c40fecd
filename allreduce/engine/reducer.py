"""How the engine reduces: the one place that calls the algorithms.

The engine thread hands every reduction here, in three kinds:

* ``control``: small control vectors (negotiation bits, overflow flags), by
  recursive doubling over the engine's transport, so every wait is bounded;
* ``allreduce``: one buffer (a fusion buffer, or a large tensor reduced in
  place), with the configured algorithm or ``auto``'s pick for its size;
* ``allreduce_many``: a direct batch of several arrays of one dtype, as one
  call of a many-array algorithm where the node has one (``shm``: its
  windows run across the arrays), else one call per array.

Each returns the algorithm's name, which the timeline records.
"""
from __future__ import annotations

import numpy as np

from .. import algorithms
from ..comm import Communicator
from ..config import Config
from ..ops import Op
from ..transport.base import Transport

__all__ = ["Reducer"]


class Reducer:
    """The engine's reductions over ``transport``, with ``comm``'s workspace and ``auto`` picks.

    Attributes:
        many: the many-array algorithm direct batches use (``shm`` on one node), or None.
    """

    def __init__(self, transport: Transport, comm: Communicator, config: Config):
        self.transport, self.comm = transport, comm
        self.algorithm, self.segment_bytes = config.algorithm, config.segment_bytes
        # Direct batches on one node go through one many-array call (shm's windows run across the
        # arrays): see allreduce_many. Elsewhere each array of a direct batch is a call of its own.
        self.many = self.algorithm if self.algorithm in algorithms.MANY else next(
            (n for n in comm.auto_candidates if n in algorithms.MANY), None) \
            if self.algorithm == "auto" else None

    def control(self, buf: np.ndarray, op: Op) -> str:
        """Reduce a small control vector (negotiation, overflow flags) with recursive doubling over
        the engine's transport: every wait is bounded, so a peer whose engine stopped turns into a
        ``TransportTimeoutError`` here instead of a hang in ``MPI_Allreduce``."""
        algorithms.get("rd")(self.transport, buf, op, workspace=self.comm.workspace, segment_bytes=0)
        return "rd"

    def allreduce(self, buf: np.ndarray, op: Op, src: np.ndarray | None = None) -> str:
        """Reduce ``buf`` in place (or ``src`` into ``buf``) with the configured algorithm; return
        the algorithm's name."""
        name = self.algorithm
        if name == "auto":
            name = self.comm.pick(buf.nbytes)
        algorithms.run(name, self.transport, buf, op, workspace=self.comm.workspace,
                       segment_bytes=self.segment_bytes, src=src)
        return name

    def allreduce_many(self, bufs: list, op: Op, srcs: list) -> str:
        """:meth:`allreduce` of several arrays of one dtype (a direct batch): one call of the
        many-array algorithm where there is one (:attr:`many`: shm on one node), else one call
        each, chosen per size (a lone array, too: the model's pick for its size, as a blocking call).

        On one node the many-call is taken even where the cost model ranks another algorithm
        first for the batch's total size: that one would need a call per array (or a copy into a
        joint buffer), which the model does not price. ResNet-50's gradients in place, -np 2,
        interleaved with a raw allreduce of the same bytes (median of 20, two runs): 38 and 33 ms
        a step with the model's per-array choices for the 29 tensors of 1 MiB and up (mpi and
        shm, on this VM's cold table) and the rest fused, 26 and 25 ms with its 52 tensors of
        64 KiB and up in one shm many-call, raw 26 and 23 ms.
        """
        name = self.many if len(bufs) > 1 else None      # one array: one call of the model's pick
        if name is None:
            name = self.algorithm
            if name == "auto":
                name = self.comm.pick(sum(b.nbytes for b in bufs))
            if name not in algorithms.MANY:
                return "+".join(sorted({self.allreduce(b, op, s) for b, s in zip(bufs, srcs)}))
        algorithms.run_many(name, self.transport, bufs, op, srcs=srcs)
        return name
