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

Measured, not assumed: with ``auto`` on MPI, the first calls of each batch
(its array count, total bytes and dtype: a training step repeats its batches)
time the many-call against ``rhd`` per array (:data:`EACH`), the way
``auto`` tunes a blocking call (:mod:`allreduce.autotune`: rounds of blocks,
the scores agreed by a MAX allreduce, a recheck), and keep the faster. On the
2-core VM ``shm`` usually wins, but some launches run ``shm`` several times
slower while MPI's point-to-point messages hold (docs/10): ResNet-50's step,
-np 2, took 3.4x a raw allreduce (one rhd call on the joined bytes) in such
a launch and 1.1x in the next, by hand. A kept way is watched as ``auto``'s
picks are (:class:`allreduce.autotune.Watch`): once a second's calls of it
run 2x off its winning score on the slowest rank, the batch is timed both
ways again (at most three times). Before the watch, one launch kept the many-call (20.6 against
33.9 ms) and the step then ran at 2x the raw allreduce once the state turned.
"""
from __future__ import annotations

import time

import numpy as np

from .. import algorithms, autotune
from ..algorithms import adasum
from ..comm import Communicator
from ..config import Config
from ..ops import Op
from ..transport.base import Transport

__all__ = ["Reducer", "STALE_CALLS", "EACH"]

#: The many-call's contender, run on each array of the batch: halving-doubling, bandwidth-optimal
#: over MPI's point-to-point messages (no shared segment). ResNet-50's 52 large gradients, -np 2,
#: five launches by hand: the many-call 12.7-14.8 ms, rhd per array 19-24, MPI_Allreduce per
#: array 28-35 (one rhd call on all 97 MiB at once: 14-20 ms).
EACH = "rhd"

#: A lone array this large (a direct batch of one: tfops' eager ``allreduce`` of one large tensor)
#: takes the many-call too (``shm`` reads the input where it lies and writes the new result) where
#: ``auto`` is on and the node has one, not the cold-cache model's pick. -np 2, one launch, best of
#: 5 blocks (tfops.allreduce, the engine's algorithm forced per variant): 4 MiB shm 1.17 ms, rhd
#: 1.48, mpi 1.87 (the pick was rhd: 1.45); 16 MiB 4.4, 6.3, 10.7 (pick 5.7); 64 MiB 19.8, 28.1,
#: 48.5 (pick shm). Not timed per launch as batches are: a lone tensor is seldom called the ~150
#: times a trial and its recheck take.
LONE_MANY_BYTES = 1 << 20

#: A batch whose trial has not run in this many tuned batch calls is forgotten (a rare batch, met
#: once when the tensors split differently, would otherwise keep the tuner busy for good).
STALE_CALLS = 64


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
        # Time the many-call against EACH per array where auto tunes (the MPI transport, one node).
        self.tunes = self.many is not None and self.algorithm == "auto" and comm.tuner is not None
        # The same books as auto's (trials, agreed scores in ``tuner.decided``, watches, reopen
        # counts), keyed by batch instead of by size.
        self.tuner = autotune.AutoTuner() if self.tunes else None
        self.batch_picks: dict[tuple, str] = {}           # batch -> "many" or "each", agreed
        self._last: dict[tuple, int] = {}                 # batch in trial -> the call that last ran it
        self._calls = 0                                   # tuned batch calls so far (the same on every rank)

    @property
    def tuning(self) -> bool:
        """True while a batch met more than once still times its ways (one met once, when the
        tensors happened to split differently, may never come again)."""
        return self.tuner is not None and any(trial.calls > 1 for trial in self.tuner.trials.values())

    def _agree_max(self, values: list[float]) -> list[float]:
        """Every rank's maximum of each of ``values`` (a control allreduce)."""
        out = np.array(values, np.float64)
        self.control(out, Op.MAX)
        return out.tolist()

    def control(self, buf: np.ndarray, op: Op) -> str:
        """Reduce a small control vector (negotiation, overflow flags) with recursive doubling over
        the engine's transport: every wait is bounded, so a peer whose engine stopped turns into a
        ``TransportTimeoutError`` here instead of a hang in ``MPI_Allreduce``."""
        algorithms.get("rd")(self.transport, buf, op, workspace=self.comm.workspace, segment_bytes=0)
        return "rd"

    def allreduce(self, buf: np.ndarray, op: Op, src: np.ndarray | None = None) -> str:
        """Reduce ``buf`` in place (or ``src`` into ``buf``) with the configured algorithm; return
        the algorithm's name."""
        if op is Op.ADASUM:                   # not element-wise: its own algorithm, one tensor a call
            if src is not None:
                buf[...] = src
            adasum.allreduce(self.transport, buf, op, workspace=self.comm.workspace)
            return "adasum"
        name = self.algorithm
        if name == "auto":
            name = self.comm.pick(buf.nbytes)
        algorithms.run(name, self.transport, buf, op, workspace=self.comm.workspace,
                       segment_bytes=self.segment_bytes, src=src)
        return name

    def allreduce_many(self, bufs: list, op: Op, srcs: list) -> str:
        """:meth:`allreduce` of several arrays of one dtype (a direct batch): one call of the
        many-array algorithm where there is one (:attr:`many`: shm on one node), else one call
        each, chosen per size (a lone array, too: the model's pick for its size, as a blocking call,
        except one of :data:`LONE_MANY_BYTES` or more under ``auto``, which takes the many-call).

        On one node the many-call is taken even where the cost model ranks another algorithm
        first for the batch's total size: that one would need a call per array (or a copy into a
        joint buffer), which the model does not price. ResNet-50's gradients in place, -np 2,
        interleaved with a raw allreduce of the same bytes (median of 20, two runs): 38 and 33 ms
        a step with the model's per-array choices for the 29 tensors of 1 MiB and up (mpi and
        shm, on this VM's cold table) and the rest fused, 26 and 25 ms with its 52 tensors of
        64 KiB and up in one shm many-call, raw 26 and 23 ms. Under ``auto`` on MPI the
        many-call is not taken on trust: each batch is timed against :data:`EACH` per array
        (:meth:`_tuned_many`, the module's docstring).
        """
        if op is Op.ADASUM:
            return "+".join(sorted({self.allreduce(b, op, s) for b, s in zip(bufs, srcs)}))
        if len(bufs) > 1:
            name = self.many
            if name is not None and self.tunes:
                return self._tuned_many(bufs, op, srcs)
        elif self.many is not None and self.algorithm == "auto" and bufs[0].nbytes >= LONE_MANY_BYTES:
            name = self.many                              # a lone large array: LONE_MANY_BYTES
        else:
            name = None                                   # one array: one call of the model's pick
        if name is None:
            name = self.algorithm
            if name == "auto":
                name = self.comm.pick(sum(b.nbytes for b in bufs))
            if name not in algorithms.MANY:
                return "+".join(sorted({self.allreduce(b, op, s) for b, s in zip(bufs, srcs)}))
        algorithms.run_many(name, self.transport, bufs, op, srcs=srcs)
        return name

    def _tuned_many(self, bufs: list, op: Op, srcs: list) -> str:
        """A direct batch by the measured faster way: the many-call, or :data:`EACH` per array."""
        key = (len(bufs), sum(b.nbytes for b in bufs), bufs[0].dtype.str)
        tuner = self.tuner
        choice = self.batch_picks.get(key)
        if choice is not None:
            watch = tuner.watches.get(key)
            start = time.perf_counter()
            name = self._run_batch(choice, bufs, op, srcs)
            if watch is not None and watch.record(time.perf_counter() - start) \
                    and tuner.check(watch, self._agree_max) is not None:
                del self.batch_picks[key]                    # its time moved: time both ways again
            return name
        self._calls += 1
        for stale in [k for k, last in self._last.items() if last < self._calls - STALE_CALLS]:
            del self._last[stale]                         # a rare batch: forget it, start again if it returns
            tuner.trials.pop(stale, None)
        trial = tuner.trials.get(key) or tuner.start(key, ["many", "each"], autotune.MIN_TRIALS)
        self._last[key] = self._calls
        start = time.perf_counter()
        name = self._run_batch(trial.current(), bufs, op, srcs)
        if trial.record(time.perf_counter() - start):    # the same call on every rank: agree
            kept = tuner.finish_round(trial, self._agree_max, watch=True)
            if kept is not None:
                del self._last[key]
                if len(self.batch_picks) >= 4096:            # every rank clears at the same call
                    self.batch_picks.clear()
                self.batch_picks[key] = kept
        return name

    def _run_batch(self, choice: str, bufs: list, op: Op, srcs: list) -> str:
        if choice == "many":
            algorithms.run_many(self.many, self.transport, bufs, op, srcs=srcs)
            return self.many
        for b, s in zip(bufs, srcs):
            algorithms.run(EACH, self.transport, b, op, workspace=self.comm.workspace,
                           segment_bytes=self.segment_bytes, src=s)
        return EACH
