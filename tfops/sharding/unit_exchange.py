"""Stage 3's collectives: a unit's allgather (prefetched one unit ahead) and the reduce-scatter of
its gradients, on one thread of their own, in the order they are handed over.

A step of a model of units 0..L-1, as each rank's queue sees it (G: allgather, RS: reduce-scatter;
the prefetch of the next unit is handed over when the current one's gather is asked for)::

    forward    G0  G1 ........ (unit 0 computes while G1 runs) ... G2 (unit 1 computes) ... G(L-1)
    backward   G(L-1) G(L-2) RS(L-1) G(L-3) RS(L-2) ...  G0 RS1 RS0

Every rank hands the same collectives over in the same order (the graph orders them: a unit's
gather waits for its input, its backward gather for the gradient from above, the gradient it
passes down for its reduce-scatter's hand-over), and one worker runs them first in, first
out, so the rings meet. Each call is checked (``Communicator.check_agreement``: same
collective, count and dtype on every rank, else ``MismatchError`` on every rank).

Cost per unit of n bytes: forward gather (p-1)/p n, backward gather (p-1)/p n, reduce-scatter
(p-1)/p n, each in (p-1) alpha; 1.5x the bytes of one allreduce of the gradients (the ZeRO
paper's stage 3 figure). Memory: the gathered block and the unpacked weights (2n) while a
gather finishes, the unit's weights (n) while it computes, one more unit's (n) while its
prefetch waits. The block (the largest unit's n, and this rank's n/p to send) is kept from call
to call (:class:`Scratch`): every gather and reduce-scatter writes one, and a new one is paid in
page faults each time.

``timeline`` records what ran when (``gather`` and ``reduce_scatter`` on the worker, with the
time each was handed over; ``forward`` and ``backward`` while a unit's weights were whole), so a
test can see a prefetch handed over before the compute it should overlap.
"""
from __future__ import annotations

import concurrent.futures
import json
import time

import numpy as np

from allreduce.algorithms.allgather import allgatherv
from allreduce.algorithms.reducescatter import reducescatter as _ring_reducescatter
from allreduce.ops import Average, dtype_code

from ..collectives.dispatch import in_step
from .params import Status, UnitLayout, pack, unpack

__all__ = ["UnitExchange", "Scratch", "gather_unit", "reducescatter_unit"]


class Scratch:
    """The worker's buffers, reused from call to call: a unit's receive block (the allgather's
    output, the reduce-scatter's packed input) and this rank's send block, one each per dtype,
    the size of the largest unit so far (exact: a power of two could double a large unit's).
    A fresh 0.8 MB block cost 0.35 ms of page faults a call (one process, MALLOC_MMAP_THRESHOLD_
    at 128 KiB, as benchmarks/plan_bench.py runs) and a block of examples/gpt.py needs one per
    gather and per reduce-scatter. Only the exchange's one worker thread uses them, one call at a
    time: each is dead once its call returns (unpacked, reduced)."""

    def __init__(self):
        self._bufs: dict[tuple[str, str], np.ndarray] = {}

    def get(self, use: str, count: int, dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` for ``use`` ("block" or "send"); contents undefined."""
        key = (use, np.dtype(dtype).name)
        buf = self._bufs.get(key)
        if buf is None or buf.size < count:
            buf = self._bufs[key] = np.empty(count, dtype)
        return buf[:count]

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def gather_unit(comm, layout: UnitLayout, shards: list[np.ndarray], *, first: bool = False,
                scratch: Scratch | None = None) -> list[np.ndarray]:
    """Every whole weight of a unit from each rank's pieces (``shards``: this rank's, one flat array
    per weight); ``first``: the step's first collective, which meets the engine (:func:`in_step`);
    ``scratch``: reuse its blocks (else new ones)."""
    scratch = scratch or Scratch()
    fulls: list = [None] * len(shards)
    for group, members in zip(layout.groups, layout.members):
        out = scratch.get("block", sum(group.blocks), group.dtype)
        if comm.size == 1:
            mine = out
        else:
            mine = scratch.get("send", group.block(comm.rank), group.dtype)
        if members:
            np.concatenate([np.asarray(shards[i], group.dtype).reshape(-1) for i in members], out=mine)
        if comm.size > 1:
            def run(mine=mine, out=out, group=group):
                comm.check_agreement("allgather", count=out.size, dtype=dtype_code(out.dtype))
                allgatherv(comm.transport, mine, out, list(group.blocks))
            in_step(run, comm)() if first else run()
            first = False
        for i, full in zip(members, unpack(group, out)):
            fulls[i] = full
    return fulls


def reducescatter_unit(comm, layout: UnitLayout, grads: list[np.ndarray], *,
                       scratch: Scratch | None = None) -> list[np.ndarray]:
    """This rank's pieces of the unit's gradients (``grads``: whole, one per weight), averaged over
    the ranks: one ring reduce-scatter per dtype; ``scratch``: pack into its block (else a new one)."""
    scratch = scratch or Scratch()
    parts: list = [None] * len(grads)
    for group, members in zip(layout.groups, layout.members):
        buf = pack(group, [np.asarray(grads[i]) for i in members],
                   out=scratch.get("block", sum(group.blocks), group.dtype))
        out = np.empty(group.block(comm.rank), group.dtype)       # handed to TensorFlow: a new one
        if comm.size == 1:
            out[:] = buf
        else:
            comm.check_agreement("reducescatter", count=buf.size, dtype=dtype_code(buf.dtype), op=int(Average))
            _ring_reducescatter(comm.transport, buf, out, list(group.blocks), Average, workspace=comm.workspace)
        inner = group.inner(comm.rank)
        for k, i in enumerate(members):
            parts[i] = out[inner[k]:inner[k] + group.pieces[k].counts[comm.rank]]
    return parts


class UnitExchange:
    """The collectives of the units sharded over ``comm``, run on one worker thread in hand-over order."""

    def __init__(self, comm, *, prefetch: bool = True):
        self.comm, self.prefetch = comm, prefetch
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tfops-fully-shard")
        self.scratch = Scratch()                         # the worker's blocks, reused (one call at a time)
        self._gathers: dict[tuple[int, str], concurrent.futures.Future] = {}
        self._scatters: dict[int, concurrent.futures.Future] = {}
        self._since: dict[int, float] = {}
        self._ran: set[tuple[int, str]] = set()          # (unit, phase) gathered since the step began
        self.status: dict[int, Status] = {}
        self.timeline: list[dict] = []

    # -- gathers ---------------------------------------------------------------------------
    def _submit_gather(self, unit, shards, phase: str, first: bool) -> concurrent.futures.Future:
        self.status[unit.index] = Status.IN_FLIGHT
        arrays = [np.array(s, copy=True) for s in shards]   # TF may reuse its buffers once the op returns
        queued = time.perf_counter()

        def run():
            t0 = time.perf_counter()
            fulls = gather_unit(self.comm, unit.layout, arrays, first=first, scratch=self.scratch)
            self._record(unit, "gather", phase, t0, queued=queued)
            return fulls
        return self._pool.submit(run)

    def gather(self, unit, shards, phase: str, *, after=None, after_shards=None, first: bool = False) -> list[np.ndarray]:
        """The unit's whole weights for ``phase`` ("forward" or "backward"): its prefetch if one was
        handed over, else a gather now; then the prefetch of ``after`` (the next unit to run)."""
        fut = self._gathers.pop((unit.index, phase), None) or self._submit_gather(unit, shards, phase, first)
        self._ran.add((unit.index, phase))
        ahead = None if after is None else (after.index, phase)
        if self.prefetch and ahead is not None and ahead not in self._gathers and ahead not in self._ran:
            self._gathers[ahead] = self._submit_gather(after, after_shards, phase, False)
        fulls = fut.result()
        self.status[unit.index] = Status.AVAILABLE
        self._since[unit.index] = time.perf_counter()
        return fulls

    def release(self, unit, phase: str) -> None:
        """The unit's compute is done: its whole weights go (TF frees them once nothing reads them)."""
        self.status[unit.index] = Status.NOT_AVAILABLE
        self._record(unit, phase, phase, self._since.pop(unit.index, time.perf_counter()))

    # -- reduce-scatters -------------------------------------------------------------------
    def submit_reduce_scatter(self, unit, grads) -> None:
        """Hand the unit's whole gradients over; the ring runs after everything handed over before."""
        self.release(unit, "backward")
        arrays = [np.asarray(g) for g in grads]

        def run():
            t0 = time.perf_counter()
            parts = reducescatter_unit(self.comm, unit.layout, arrays, scratch=self.scratch)
            self._record(unit, "reduce_scatter", "backward", t0)
            return parts
        self._scatters[unit.index] = self._pool.submit(run)

    def wait_reduce_scatter(self, unit) -> list[np.ndarray]:
        """This rank's pieces of the unit's averaged gradients, once its ring is done."""
        return self._scatters.pop(unit.index).result()

    def drop_pending(self) -> None:
        """Forget prefetches no step will use (a forward without a backward, a failed step), once
        they have run: a cancel could stop a prefetch on one rank that has begun on another."""
        for fut in self._gathers.values():
            fut.exception()
        self._gathers.clear()
        self._ran.clear()

    def close(self) -> None:
        """Retire this exchange (an elastic re-cut makes a new one on the new communicator): queued
        work is cancelled and the worker ends once its current call returns, not waited for (a call
        on the old, revoked world ends with an error nobody reads)."""
        for fut in list(self._gathers.values()) + list(self._scatters.values()):
            fut.cancel()
        self._gathers.clear()
        self._scatters.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the timeline ----------------------------------------------------------------------
    def _record(self, unit, what: str, phase: str, t0: float, queued: float | None = None) -> None:
        self.timeline.append({"unit": unit.index, "name": unit.name, "what": what, "phase": phase,
                              "queued": t0 if queued is None else queued, "start": t0, "end": time.perf_counter()})
        del self.timeline[:-10000]                       # the recent steps only

    def write_timeline(self, path: str) -> None:
        """The timeline as a Chrome trace (chrome://tracing, Perfetto): one row for the worker's
        collectives, one for the compute while weights are whole."""
        t0 = min((e["start"] for e in self.timeline), default=0.0)
        rows = [{"name": f"{e['what']} {e['name']}", "ph": "X", "pid": self.comm.rank,
                 "tid": "collectives" if e["what"] in ("gather", "reduce_scatter") else "compute",
                 "ts": (e["start"] - t0) * 1e6, "dur": (e["end"] - e["start"]) * 1e6} for e in self.timeline]
        with open(path, "w") as f:
            json.dump({"traceEvents": rows}, f)
