"""The engine thread's side of :class:`~allreduce.engine.engine.Engine`: the cycle.

::

    every cycle_time ms (pacing.py says when)
      1. drain       the submit queue into ``pending`` (a custom compressor compresses here, once)
      2. negotiate   which names are ready on ALL ranks (negotiation.py: one small allreduce)
      3. fail        mismatches and stalls, on every rank alike; a joined rank adds zeros
      4. plan        the ready names into batches: one dtype, op and comm hook each (fusion.py)
      5. run         each batch through its comm hook: ``hook.run_batch(batch, comm)``
                     (hooks.py; the compressors are the simplest hooks: pack, one allreduce, unpack)
      6. finish      set every handle's result, wake the waiters once per batch

Every rank runs the same cycles in lockstep, on the same agreed lists, so
every rank forms the same batches and runs the same collectives in the same
order. What the caller's thread does (submit, admit, join, shutdown) is
engine.py.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ..errors import AllreduceError, ShutdownError, TransportError
from ..ops import SUPPORTED_DTYPES, Op
from .compression import BUILTIN, precompress
from .fusion import plan
from .handle import Entry, announce
from .pacing import tight_timer_slack
from .stall import stall_error
from .timeline import trace_negotiation

__all__ = ["EngineThread"]

log = logging.getLogger("allreduce.engine")


def _drop_copies(entry: Entry) -> None:
    """A finished entry is its caller's handle from now on: let go of what the engine made for it
    (a contiguous copy, a compressor's payload), which the caller may hold much longer."""
    if not entry.shares:
        entry.flat = entry.array
    entry.payload = entry.ctx = None


class EngineThread:
    """The engine thread's methods of :class:`~allreduce.engine.engine.Engine` (a base class of it:
    the state they use is set up in ``Engine.__init__``)."""

    def _run(self) -> None:
        tight_timer_slack()
        try:
            while True:
                start = time.monotonic()
                if self._cycle():
                    break
                self.pacer.pause(start, idle=self.negotiator.idle, stopping=lambda: self._stopping,
                                 served=self._served)
        except BaseException as exc:  # noqa: BLE001 - every handle must learn about it
            log.error("rank %d: allreduce engine failed: %s: %s", self.rank, type(exc).__name__, exc)
            error = exc if isinstance(exc, AllreduceError) else AllreduceError(
                f"rank {self.rank}: the allreduce engine failed: {type(exc).__name__}: {exc}")
            self._fail_all(error)
        finally:
            self._fail_all(ShutdownError(f"rank {self.rank}: the allreduce engine was shut down before "
                                         "this tensor was submitted by every rank"))
            if self.timeline is not None:
                self.timeline.close()
            self.comm.close()

    def _cycle(self) -> bool:
        """One cycle; True when the engine stops."""
        self.cycles += 1
        if self.mark_cycles:
            self.timeline.instant("engine", "CYCLE_START")
        stopping = self._stopping                 # read before draining: later submits are refused
        self._drain()
        cutoff = self.stall.inspect(self.negotiator.partial)
        out = self.negotiator.negotiate(self.pending, shutdown=stopping, cutoff=cutoff)
        agreed = time.monotonic()
        if self.timeline is not None:
            trace_negotiation(self.timeline, self.pending, out.ranks, out.ready, agreed, self.size)
        for name, error in out.errors.items():
            entry = self.pending.pop(name, None)            # None: a joined rank that lacks it
            if entry is not None:
                self._finish(entry, error)
        for name, meta in out.zeros.items():                 # joined: reduce zeros in this rank's place
            self.pending[name] = self._zeros(name, meta)
        for name, (ready, missing) in out.stalled.items():
            entry = self.pending.pop(name, None)
            if entry is not None:
                self._finish(entry, stall_error(name, ready, missing, self.config.stall_shutdown_time,
                                                out.out_of_step))
        ready = [self.pending.pop(name) for name in out.ready]
        self._served = bool(ready)
        for batch in plan(ready, self.config.fusion_threshold, self.direct_bytes):
            if self.timeline is not None:
                self.timeline.spans([e.name for e in batch.entries], "WAIT_FOR_BATCH", agreed, time.monotonic())
            self._run_batch(batch)
        if out.joined is not None:                           # every rank has joined
            with self._lock:
                handle, self._join = self._join, None
            if handle is not None:
                handle._set(out.joined)
        if out.shutdown:
            with self._lock:
                self._stopping = True
                if self._stopped is None:
                    self._stopped = ShutdownError("shut down by ar.shutdown() on this or a peer rank")
            return True
        return False

    def _run_batch(self, batch) -> None:
        """Reduce one fused batch; an error fails that batch's handles, never leaves them waiting."""
        try:
            results = batch.compressor.run_batch(batch, self.hook_comm)   # the batch's comm hook
            inflight = self._inflight
            for entry, result in zip(batch.entries, results):        # _finish, inlined: ~0.2 us less for each tensor
                if entry.locked:                 # Entry.release, inlined
                    entry.locked = False
                    try:
                        entry.array.setflags(write=True)
                    except ValueError:           # its base became read-only meanwhile: leave it
                        pass
                inflight.discard(entry.name)
                if entry.payload is not None or not entry.shares:
                    _drop_copies(entry)
                if not entry._done:              # Handle._set, less its announce: once, below
                    if isinstance(result, BaseException):
                        entry._error = result
                    else:
                        entry._result = result
                    entry._done = True
            announce()
        except Exception as exc:  # noqa: BLE001 - every handle of the batch must hear about it
            error = exc if isinstance(exc, AllreduceError) else AllreduceError(
                f"rank {self.rank}: reducing {', '.join(repr(e.name) for e in batch.entries[:4])} failed: "
                f"{type(exc).__name__}: {exc}")
            for entry in batch.entries:
                if not entry._done:              # not finished above
                    self._finish(entry, error)
            announce()                           # those finished above, too
            if isinstance(exc, TransportError):
                raise                         # the ranks may be out of step: stop the engine everywhere

    def _drain(self) -> None:
        with self._lock:                     # once per cycle: a submit must not append to a drained list
            queue, self._queue = self._queue, []
            if self._join_queued:
                self._join_queued, self.negotiator.joining = False, True
        pending, timeline = self.pending, self.timeline
        if timeline is not None:                 # NEGOTIATE spans start here, QUEUE spans end here
            now = time.monotonic()
            for entry in queue:
                timeline.span(entry.name, "QUEUE", entry.submitted, now)
                entry.submitted = now
        for entry in queue:
            if entry.wire is None:               # compressed (no compression: set at submit)
                flat = entry.flat
                wire = entry.compressor.wire_dtype(flat.dtype)
                if wire is None:
                    error = precompress(entry, self.rank)   # a custom compressor: compress now, once
                    if error is not None:
                        self._finish(entry, error)
                        continue
                else:
                    entry.wire = wire, flat.size      # what fusion._wire would compute again
            pending[entry.name] = entry

    def _finish(self, entry: Entry, result) -> None:
        # No lock: set.discard is atomic in CPython, and the engine thread taking the submit
        # lock once per tensor made submitting threads queue behind it (a lock convoy: the
        # holder waits for the GIL while the submitter waits for the lock), ~20 us per submit.
        entry.release()
        self._inflight.discard(entry.name)
        _drop_copies(entry)
        if isinstance(result, BaseException):
            entry._fail(result)
        else:
            entry._set(result)

    def _zeros(self, name: str, meta) -> Entry:
        """A tensor this joined rank never submitted: zeros of the agreed shape (a group's
        arrays flat, back to back), dtype, op and compression."""
        shape, dtype_name, op, compressor = meta
        if shape and isinstance(shape[0], tuple):
            shape = (sum(int(np.prod(s, dtype=np.int64)) for s in shape),)
        dtype = next(d for d in SUPPORTED_DTYPES if d.name == dtype_name)
        return Entry(name, np.zeros(shape, dtype), Op(op), BUILTIN[compressor])

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._stopping = True
            if self._stopped is None:
                self._stopped = error
            queue, self._queue = self._queue, []
            join, self._join, self._join_queued = self._join, None, False
        if join is not None:
            join._fail(error)
        for entry in list(self.pending.values()) + queue:
            self._finish(entry, error)
        self.pending.clear()
