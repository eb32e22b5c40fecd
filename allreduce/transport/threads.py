"""In-process transport: ``p`` ranks are ``p`` threads sharing one mailbox.

This is how the tests run thousands of cases in seconds, and how a student
steps through an algorithm without ``mpirun``::

    from allreduce.transport.threads import run_threads
    results = run_threads(4, lambda comm: comm.rank * 10)   # [0, 10, 20, 30]

Semantics follow MPI's strictest reading, so code that works here does not
deadlock under MPI:

* ``isend`` copies the data at once, but its request completes only when the
  receiver has taken the message (rendezvous). A blocking ``send`` therefore
  waits for the matching receive, as a large MPI message does.
* Messages between one pair on one tag arrive in order (FIFO).
* Every wait has a timeout. If one rank raises, the world is aborted and every
  other waiting rank raises ``PeerLostError`` naming it, instead of hanging.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import numpy as np

from ..errors import PeerLostError, TransportError, TransportTimeoutError
from .base import Transport

__all__ = ["ThreadWorld", "ThreadTransport", "run_threads"]


class _Message:
    __slots__ = ("data", "taken")

    def __init__(self, data: bytes):
        self.data = data
        self.taken = False


class _Channel:
    """Messages from one rank to another on one tag, numbered in posting order (MPI's FIFO rule)."""
    __slots__ = ("msgs", "sent", "posted")

    def __init__(self):
        self.msgs: dict[int, _Message] = {}
        self.sent = 0
        self.posted = 0


class ThreadWorld:
    """The shared state of ``size`` thread ranks: mailboxes, a barrier, an abort flag."""

    def __init__(self, size: int, *, timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._channels: dict[tuple[int, int, int], _Channel] = collections.defaultdict(_Channel)
        self._barrier = threading.Barrier(size)
        self.failed: tuple[int, BaseException] | None = None

    def transport(self, rank: int) -> "ThreadTransport":
        return ThreadTransport(self, rank)

    def abort(self, rank: int, exc: BaseException) -> None:
        """Rank ``rank`` failed: wake every waiter so it raises instead of hanging."""
        with self._cond:
            if self.failed is None:
                self.failed = (rank, exc)
            self._cond.notify_all()
        self._barrier.abort()

    def _wait_for(self, predicate: Callable[[], bool], me: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not predicate():
            if self.failed is not None and self.failed[0] != me:
                rank, exc = self.failed
                raise PeerLostError(f"rank {me}: peer rank {rank} failed while this rank waited "
                                    f"to {what}: {type(exc).__name__}: {exc}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeoutError(f"rank {me}: timed out after {self.timeout:g} s waiting to {what}")
            self._cond.wait(min(left, 0.5))


class _SendRequest:
    __slots__ = ("_world", "_msg", "_me", "_dest")

    def __init__(self, world: ThreadWorld, msg: _Message, me: int, dest: int):
        self._world, self._msg, self._me, self._dest = world, msg, me, dest

    def wait(self) -> None:
        world = self._world
        with world._cond:
            world._wait_for(lambda: self._msg.taken, self._me, f"send to rank {self._dest}")


class _RecvRequest:
    __slots__ = ("_world", "_chan", "_seq", "_buf", "_me", "_source", "_done")

    def __init__(self, world: ThreadWorld, chan: _Channel, seq: int, buf: np.ndarray, me: int, source: int):
        self._world, self._chan, self._seq, self._buf = world, chan, seq, buf
        self._me, self._source, self._done = me, source, False

    def wait(self) -> None:
        if self._done:
            return
        world, msgs, seq = self._world, self._chan.msgs, self._seq
        with world._cond:
            world._wait_for(lambda: seq in msgs, self._me, f"receive from rank {self._source}")
            msg = msgs.pop(seq)
            msg.taken = True
            world._cond.notify_all()
        view = self._buf.reshape(-1).view(np.uint8)
        if len(msg.data) != view.nbytes:
            raise TransportError(f"rank {self._me}: expected {view.nbytes} bytes from rank "
                                 f"{self._source}, got {len(msg.data)}")
        view[:] = np.frombuffer(msg.data, dtype=np.uint8)
        self._done = True


class ThreadTransport(Transport):
    """One rank's end of a :class:`ThreadWorld`."""

    def __init__(self, world: ThreadWorld, rank: int):
        if not 0 <= rank < world.size:
            raise ValueError(f"rank {rank} out of range for a world of {world.size}")
        self.world, self.rank, self.size = world, rank, world.size

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: peer {peer} out of range [0, {self.size})")

    def isend(self, buf, dest, tag=0):
        self._check_peer(dest)
        msg = _Message(np.ascontiguousarray(buf).tobytes())
        world = self.world
        with world._cond:
            chan = world._channels[(self.rank, dest, tag)]
            chan.msgs[chan.sent] = msg
            chan.sent += 1
            world._cond.notify_all()
        return _SendRequest(world, msg, self.rank, dest)

    def irecv(self, buf, source, tag=0):
        self._check_peer(source)
        world = self.world
        with world._cond:
            chan = world._channels[(source, self.rank, tag)]
            seq = chan.posted
            chan.posted += 1
        return _RecvRequest(world, chan, seq, buf, self.rank, source)

    def barrier(self) -> None:
        try:
            self.world._barrier.wait(self.world.timeout)
        except threading.BrokenBarrierError:
            failed = self.world.failed
            who = f"peer rank {failed[0]} failed" if failed else "timed out"
            raise PeerLostError(f"rank {self.rank}: barrier broken: {who}") from None


def run_threads(size: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
                world: ThreadWorld | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(transport, *args, **kwargs)`` on ``size`` thread ranks; return each rank's result.

    If any rank raises, the first exception (by rank) is re-raised here after
    every thread has stopped.
    """
    world = world or ThreadWorld(size, timeout=timeout)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.transport(rank), *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
            errors[rank] = exc
            world.abort(rank, exc)

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
        if t.is_alive():
            raise TransportTimeoutError(f"thread {t.name} did not finish within {timeout + 5:g} s")
    primary = [e for e in errors if e is not None and not isinstance(e, PeerLostError)]
    if primary or any(errors):
        raise (primary or [e for e in errors if e is not None])[0]
    return results
