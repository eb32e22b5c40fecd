"""A transport that forwards every call to a real one and writes down what happened.

The explain tool runs the real algorithm code on the in-process transport,
with each rank's transport wrapped in a :class:`RecordingTransport`. The
wrapper records, in one shared :class:`Recording`:

* every ``mark(phase, step)`` of every rank, with a copy of the rank's
  tracked buffers at that moment (the state *before* the step);
* every message: sender, receiver, tag, the sender's step when it sent,
  the receiver's step when the receive completed, the elements sent (their
  offset in a tracked buffer, or ``None`` for scratch), a copy of the data,
  and its depth: 1 + the depth of the deepest message its sender had
  received (Lamport's clock), so the largest depth is the number of
  latencies on the critical path;
* every reduction (through :func:`patch_kernels`): rank, step, bytes.

How steps are cut. Each rank is "in" the step it marked last. A message
belongs to the *later* of the sender's step at ``isend`` and the receiver's
step when its receive completes: ring forwards a freshly reduced chunk at
the end of step s (sender still in s) and the neighbour consumes it in step
s + 1, which is where it belongs. The global order of steps merges every
rank's sequence of marks (ranks that sit a step out simply skip it).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Sequence
from unittest import mock

import numpy as np

from ..transport.base import Transport

__all__ = ["Recording", "RecordingTransport", "Message", "Reduction", "patch_kernels", "START"]

START = ("start", 0)   #: the step a rank is in before its first mark


@dataclass
class Message:
    """One point-to-point message, as seen from both ends."""

    src: int
    dst: int
    tag: int
    send_key: tuple[str, int]
    data: np.ndarray                                # copy of what was sent
    src_loc: tuple[str, int, int] | None            # (buffer name, offset, count) at the sender
    recv_key: tuple[str, int] | None = None
    dst_loc: tuple[str, int, int] | None = None     # where it landed at the receiver
    depth: int = 1                                  # messages on the longest chain ending in this one


@dataclass
class Reduction:
    """One call of ``reduce_into`` / ``reduce_finish_into``."""

    rank: int
    key: tuple[str, int]
    nbytes: int
    dst_loc: tuple[str, int, int] | None


@dataclass
class _RankLog:
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    key: tuple[str, int] = START
    marks: list[tuple[tuple[str, int], dict[str, np.ndarray]]] = field(default_factory=list)
    end: dict[str, np.ndarray] | None = None
    clock: int = 0                                  # depth of the deepest message received so far


class Recording:
    """Everything the ranks of one run did, in the order they did it. Thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self.ranks = [_RankLog() for _ in range(size)]
        self.messages: list[Message] = []
        self.reductions: list[Reduction] = []
        self.problems: list[str] = []               # broken promises found by the runner
        self._channels: dict[tuple[int, int, int], list[Message]] = {}
        self._posted: dict[tuple[int, int, int], int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- set up by the runner, per rank ------------------------------------------------
    def track(self, rank: int, **buffers: np.ndarray) -> None:
        """Name the buffers of ``rank`` whose contents and offsets the recording follows."""
        self.ranks[rank].buffers.update(buffers)
        self._local.rank = rank

    def finish(self, rank: int) -> None:
        """Snapshot the final contents of ``rank``'s tracked buffers."""
        log = self.ranks[rank]
        log.end = {name: b.copy() for name, b in log.buffers.items()}

    def current_rank(self) -> int | None:
        return getattr(self._local, "rank", None)

    # -- events -----------------------------------------------------------------------------
    def locate(self, rank: int, arr: np.ndarray) -> tuple[str, int, int] | None:
        """``(name, offset, count)`` of ``arr`` inside one of ``rank``'s tracked buffers, else None."""
        start = arr.__array_interface__["data"][0]
        for name, base in self.ranks[rank].buffers.items():
            b0 = base.__array_interface__["data"][0]
            if base.itemsize == arr.itemsize and b0 <= start < b0 + max(base.nbytes, 1) \
                    and start + arr.nbytes <= b0 + base.nbytes:
                return name, (start - b0) // base.itemsize, arr.size
        return None

    def on_mark(self, rank: int, key: tuple[str, int]) -> None:
        log = self.ranks[rank]
        if key == log.key or any(k == key for k, _ in log.marks):
            return                                   # a repeated mark continues the step
        log.key = key
        log.marks.append((key, {name: b.copy() for name, b in log.buffers.items()}))

    def on_send(self, rank: int, buf: np.ndarray, dest: int, tag: int) -> None:
        log = self.ranks[rank]
        msg = Message(rank, dest, tag, log.key, np.array(buf, copy=True).reshape(-1),
                      self.locate(rank, buf), depth=log.clock + 1)
        with self._lock:
            self.messages.append(msg)
            self._channels.setdefault((rank, dest, tag), []).append(msg)

    def on_post_recv(self, rank: int, source: int, tag: int) -> int:
        with self._lock:
            seq = self._posted.get((source, rank, tag), 0)
            self._posted[(source, rank, tag)] = seq + 1
        return seq

    def on_recv_done(self, rank: int, source: int, tag: int, seq: int, buf: np.ndarray) -> None:
        with self._lock:
            msg = self._channels[(source, rank, tag)][seq]
        log = self.ranks[rank]
        msg.recv_key = log.key
        log.clock = max(log.clock, msg.depth)
        msg.dst_loc = self.locate(rank, buf)

    def on_reduce(self, dst: np.ndarray, src: np.ndarray) -> None:
        rank = self.current_rank()
        if rank is None:
            return
        red = Reduction(rank, self.ranks[rank].key, src.nbytes, self.locate(rank, dst))
        with self._lock:
            self.reductions.append(red)


class _RecvRequest:
    __slots__ = ("_inner", "_rec", "_args", "_done")

    def __init__(self, inner, rec: Recording, args: tuple):
        self._inner, self._rec, self._args, self._done = inner, rec, args, False

    def wait(self) -> None:
        self._inner.wait()
        if not self._done:
            self._done = True
            self._rec.on_recv_done(*self._args)


class RecordingTransport(Transport):
    """Forwards to ``inner`` and records into ``recording``. ``send``/``recv``/``sendrecv``
    come from the base class, so they go through the recorded ``isend``/``irecv``."""

    def __init__(self, inner: Transport, recording: Recording):
        self.inner, self.recording = inner, recording
        self.rank, self.size = inner.rank, inner.size

    def __getattr__(self, name: str):
        # Anything else (the thread world that shared-memory algorithms attach to) is the inner one's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def isend(self, buf, dest, tag=0):
        self.recording.on_send(self.rank, buf, dest, tag)
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        seq = self.recording.on_post_recv(self.rank, source, tag)
        return _RecvRequest(self.inner.irecv(buf, source, tag), self.recording,
                            (self.rank, source, tag, seq, buf))

    def wait_all(self, requests: Sequence) -> None:
        for request in requests:
            request.wait()

    def barrier(self) -> None:
        self.inner.barrier()

    def mark(self, phase: str, step: int) -> None:
        self.recording.on_mark(self.rank, (phase, int(step)))
        self.inner.mark(phase, step)

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def patch_kernels(recording: Recording, *modules) -> Iterator[None]:
    """Count every reduction call (``reduce_into``, ``reduce_finish_into``, and the three that
    return whether they did it: ``reduce_first_into``, ``reduce_finish_into_both``,
    ``reduce_finish_split_into``) while the block runs; ``reduce_many_into`` and
    ``reduce_push_into`` count as one reduction per source, as the pairwise calls they stand for.

    Patches ``allreduce.kernels`` and any of ``modules`` that imported the
    functions by name; everything is restored on exit.
    """
    from .. import kernels
    names = ("reduce_into", "reduce_finish_into", "reduce_first_into", "reduce_finish_into_both",
             "reduce_finish_split_into", "reduce_many_into", "reduce_push_into")
    originals = {name: getattr(kernels, name) for name in names}
    reports_done = {"reduce_first_into", "reduce_finish_into_both", "reduce_finish_split_into"}   # False: the caller reduces another way

    inside = threading.local()   # reduce_finish_into calls reduce_into: count the outer call only

    def wrap(fn, name):
        def counted(dst, src, *args, **kwargs):
            if getattr(inside, "busy", False):
                return fn(dst, src, *args, **kwargs)
            inside.busy = True
            try:
                result = fn(dst, src, *args, **kwargs)
            finally:
                inside.busy = False
            if name in ("reduce_many_into", "reduce_push_into"):
                for one in src:
                    recording.on_reduce(dst, one)
            elif name not in reports_done or result:
                recording.on_reduce(dst, src)
            return result
        return counted

    with contextlib.ExitStack() as stack:
        for name, fn in originals.items():
            stack.enter_context(mock.patch.object(kernels, name, wrap(fn, name)))
            for module in modules:
                if getattr(module, name, None) is fn:
                    stack.enter_context(mock.patch.object(module, name, wrap(fn, name)))
        yield
