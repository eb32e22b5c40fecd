"""The timeline: a Chrome-trace / Perfetto JSON file of what the engine did to every tensor.

``ALLREDUCE_TIMELINE=/tmp/tl.json`` makes every rank write one file: rank 0
writes exactly that path, rank r > 0 writes ``/tmp/tl.rank<r>.json``. Open
one in https://ui.perfetto.dev or chrome://tracing. Each tensor is a row
(a ``tid``), with these events, in order::

    QUEUE                         submitted, not yet seen by the engine thread
    NEGOTIATE                     waiting for every rank; one tick per rank as it turns ready
    WAIT_FOR_BATCH                agreed, waiting for earlier fused batches to finish
    MEMCPY_IN_FUSION_BUFFER       packing (or COMPRESS: cast + pack in one pass)
    ALLREDUCE                     the collective; nested inside it, one span per
      reduce-scatter, allgather...  algorithm phase (from ``transport.mark``), args = steps
    MEMCPY_OUT_FUSION_BUFFER      unpacking (or DECOMPRESS)

The file is written as the events happen (one JSON object per line); the
closing bracket comes at shutdown, and viewers accept the file before that.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from ..transport.base import Transport

__all__ = ["Timeline", "TimelineTransport", "timeline_path", "trace_negotiation"]


def timeline_path(path: str, rank: int) -> Path:
    """Rank 0 writes ``path``; rank r writes ``stem.rank<r>.suffix`` next to it."""
    p = Path(path)
    return p if rank == 0 else p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


class Timeline:
    """Appends trace events for one rank to a JSON file. Thread-safe."""

    def __init__(self, path: str | Path, rank: int):
        self.path = Path(path)
        self.rank = rank
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._t0 = time.monotonic()
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _emit(self, event: dict) -> None:
        self._file.write(json.dumps(event) + ",\n")

    def _tid(self, tensor: str) -> int:
        tid = self._tids.get(tensor)
        if tid is None:
            tid = self._tids[tensor] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                        "args": {"name": tensor}})
        return tid

    def span(self, tensor: str, label: str, start: float, end: float, args: dict | None = None) -> None:
        """A complete event ``label`` on ``tensor``'s row from ``start`` to ``end`` (monotonic seconds)."""
        with self._lock:
            if self._file.closed:
                return
            event = {"name": label, "ph": "X", "pid": self.rank, "tid": self._tid(tensor),
                     "ts": self._us(start), "dur": round(max(end - start, 0.0) * 1e6, 3)}
            if args:
                event["args"] = args
            self._emit(event)

    def spans(self, tensors: Sequence[str], label: str, start: float, end: float,
              args: dict | None = None) -> None:
        for tensor in tensors:
            self.span(tensor, label, start, end, args)

    def instant(self, tensor: str, label: str, t: float | None = None, args: dict | None = None) -> None:
        """A tick on ``tensor``'s row (``ph: i``), e.g. "rank 2 ready" during NEGOTIATE."""
        with self._lock:
            if self._file.closed:
                return
            event = {"name": label, "ph": "i", "s": "t", "pid": self.rank, "tid": self._tid(tensor),
                     "ts": self._us(time.monotonic() if t is None else t)}
            if args:
                event["args"] = args
            self._emit(event)

    def close(self) -> None:
        """Finish the JSON array and close the file. Idempotent."""
        with self._lock:
            if self._file.closed:
                return
            self._file.write(json.dumps({"name": "timeline_end", "ph": "M", "pid": self.rank,
                                         "args": {}}) + "\n]\n")
            self._file.close()


class TimelineTransport(Transport):
    """Wraps the engine's transport: passes every message through, records ``mark()`` calls.

    Marks are recorded only between :meth:`record` and :meth:`stop`, i.e. during
    a fused batch's allreduce, not during the engine's own control messages.
    """

    def __init__(self, inner: Transport):
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self._marks: list[tuple[str, int, float]] | None = None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)           # e.g. ``.comm`` for the ``mpi`` algorithm

    def isend(self, buf, dest, tag=0):
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        return self.inner.irecv(buf, source, tag)

    def send(self, buf, dest, tag=0):
        self.inner.send(buf, dest, tag)

    def recv(self, buf, source, tag=0):
        self.inner.recv(buf, source, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def exchange(self, sendbuf, recvbuf, peer, tag=0):
        self.inner.exchange(sendbuf, recvbuf, peer, tag)

    def wait_all(self, requests):
        self.inner.wait_all(requests)

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        self.inner.close()

    def mark(self, phase: str, step: int) -> None:
        if self._marks is not None:
            self._marks.append((phase, step, time.monotonic()))
        self.inner.mark(phase, step)

    def record(self) -> None:
        self._marks = []

    def stop(self, end: float) -> list[tuple[str, float, float, int]]:
        """Stop recording; return ``(phase, start, end, distinct steps)``, consecutive marks merged."""
        marks, self._marks = self._marks or [], None
        phases: list[list[Any]] = []
        for phase, step, t in marks:
            if phases and phases[-1][0] == phase:
                phases[-1][3].add(step)
            else:
                phases.append([phase, t, t, {step}])
        return [(phase, start, phases[i + 1][1] if i + 1 < len(phases) else end, len(steps))
                for i, (phase, start, _, steps) in enumerate(phases)]


def trace_negotiation(tl: Timeline, pending: dict, ranks: dict, ready: list[str], agreed: float,
                      size: int) -> None:
    """One cycle's negotiation on the timeline: an instant per rank newly seen ready for each
    pending tensor (``ranks``: name -> ranks ready so far), and a NEGOTIATE span, from submit to
    ``agreed``, for each tensor every rank was ready for (``ready``)."""
    for name, who in ranks.items():
        entry = pending.get(name)
        if entry is None:
            continue
        for r in sorted(who - entry.seen):
            tl.instant(name, f"rank {r} ready", agreed, {"rank": r})
        entry.seen |= who
    for name in ready:
        entry = pending[name]
        tl.span(name, "NEGOTIATE", entry.submitted, agreed, {"ranks": size})
