"""Point-to-point messages between pipeline ranks: activations forward, their gradients back.

::

    pipeline set (ranks by pipeline_rank)      activation of micro-batch i, model chunk k -> k+1
        0 ──act──▶ 1 ──act──▶ 2 ──act──▶ 3      tag = TAG + 2*(k+1)         (the receiver's chunk)
        0 ◀─grad── 1 ◀─grad── 2 ◀─grad── 3      tag = TAG + 2*(k-1) + 1
        └───────────── act (interleaved: rank p-1's chunk c feeds rank 0's chunk c+1)

The messages ride the pipeline set's own transport (``ProcessSet.communicator.transport``: MPI,
whose shared-memory path carries them on one node), with tags of their own, so they never match
a collective's messages. Each (sender, receiver, direction, chunk) pair is its own channel and
the schedules keep micro-batches in order on it, so the n-th receive gets the n-th send (FIFO).

Sends are nonblocking: :meth:`P2P.send` keeps the array alive until :meth:`P2P.finish`. Receives
can be posted ahead (:meth:`P2P.irecv`, then :meth:`P2P.wait`); a progress thread keeps every
request moving while the caller computes. A wait blocks, within the transport's timeout
(``ALLREDUCE_TIMEOUT``, 30 s): a peer that never sends raises ``TransportTimeoutError`` naming
it, never a hang.

The shapes and dtypes of every channel are agreed once (:meth:`P2P.send_spec` /
:meth:`P2P.recv_spec`, one header of 10 int64 each) and cached by the caller; after that a
message is the bare bytes. :meth:`P2P.exchange_objects` gives every rank every rank's object (the
problems found while agreeing), so a mismatch raises on every rank alike.

Cost per message: alpha + n*beta, n the activation's bytes; a step of schedule 1f1b moves
``2m`` of them each way per rank boundary, interleaved ``2vm``.
"""
from __future__ import annotations

import pickle
import queue
import threading

import numpy as np

__all__ = ["P2P", "TAG", "act_tag", "grad_tag", "BAD_SPEC"]

TAG = 0x5100                 # above the collectives' tags; 2 per model chunk, then the control tags
MAX_DIMS = 8
BAD_SPEC = (-1, ())          # a header that says: the sender could not make its output
_SPEC_TAG, _LEN_TAG, _OBJ_TAG, _VALUE_TAG = TAG - 4, TAG - 3, TAG - 2, TAG - 1


def act_tag(k: int) -> int:
    """The tag of activations into model chunk ``k``."""
    return TAG + 2 * k


def grad_tag(k: int) -> int:
    """The tag of gradients into model chunk ``k``."""
    return TAG + 2 * k + 1


class _Pending:
    """One send or receive in flight: the progress thread sets ``done`` (and ``error``) when it completes."""
    __slots__ = ("request", "array", "done", "error")

    def __init__(self, request, array: np.ndarray):
        self.request, self.array, self.done, self.error = request, array, threading.Event(), None


_QUEUE: list = []                         # the one progress thread's queue, started on first use
_QUEUE_LOCK = threading.Lock()


def _progress_queue() -> queue.SimpleQueue:
    with _QUEUE_LOCK:
        if not _QUEUE:
            _QUEUE.append(queue.SimpleQueue())
            threading.Thread(target=_progress, args=(_QUEUE[0],), name="pipeline-p2p", daemon=True).start()
        return _QUEUE[0]


def _progress(requests: queue.SimpleQueue) -> None:
    while True:
        pending = requests.get()
        try:
            pending.request.wait()                # bounded by the transport's timeout
        except BaseException as exc:              # handed to the caller's wait()
            pending.error = exc
        pending.done.set()


class P2P:
    """Sends and receives between the ranks of one pipeline process set.

    Args:
        process_set: the ``ProcessSet`` whose ranks are the pipeline stages, in pipeline order
            (``mesh.pipeline_set``: its communicator's rank is the pipeline rank).

    A progress thread waits on every request in turn. Why: a large message goes by rendezvous,
    which moves only while some thread of each side is inside MPI; without the thread, an
    activation sent before a forward would leave only when the sender next called MPI, one chunk
    later, and the bubble grew by that much on every boundary.
    """

    def __init__(self, process_set):
        comm = process_set.communicator
        self.transport = comm.transport
        self.rank, self.size = comm.rank, comm.size
        self._sends: list[_Pending] = []      # kept alive until finish()
        self._queue = _progress_queue()


    # -- data ----------------------------------------------------------------------------
    def send(self, array: np.ndarray, peer: int, tag: int) -> None:
        """Start sending ``array`` (C-contiguous) to ``peer``; it stays referenced until :meth:`finish`."""
        array = np.ascontiguousarray(array)
        pending = _Pending(self.transport.isend(array.reshape(-1).view(np.uint8), peer, tag), array)
        self._queue.put(pending)
        self._sends.append(pending)

    def irecv(self, shape: tuple, dtype, peer: int, tag: int) -> _Pending:
        """Post a receive of an array of ``shape`` and ``dtype`` from ``peer``; :meth:`wait` for it."""
        out = np.empty(shape, dtype)
        pending = _Pending(self.transport.irecv(out.reshape(-1).view(np.uint8), peer, tag), out)
        self._queue.put(pending)
        return pending

    @staticmethod
    def wait(pending: _Pending) -> np.ndarray:
        """Block until ``pending`` completes; its array (a receive's data). Re-raises its error."""
        pending.done.wait()                       # the thread's wait is bounded: this one ends too
        if pending.error is not None:
            raise pending.error
        return pending.array

    def recv(self, shape: tuple, dtype, peer: int, tag: int) -> np.ndarray:
        """Receive an array of ``shape`` and ``dtype`` from ``peer`` (blocks, within the timeout)."""
        return self.wait(self.irecv(shape, dtype, peer, tag))

    def finish(self) -> None:
        """Wait for every send in flight (the end of a step: the arrays may then be freed)."""
        sends, self._sends = self._sends, []
        for pending in sends:
            self.wait(pending)

    # -- agreeing shapes once ------------------------------------------------------------
    def send_spec(self, spec: tuple[int, tuple[int, ...]], peer: int) -> None:
        """Send ``(dtype_code, shape)`` (``BAD_SPEC`` if the sender has none) to ``peer``."""
        code, shape = spec
        if len(shape) > MAX_DIMS:
            raise ValueError(f"pipeline activations have at most {MAX_DIMS} dimensions, got {len(shape)}")
        header = np.full(2 + MAX_DIMS, -1, np.int64)
        header[0], header[1] = code, len(shape)
        header[2:2 + len(shape)] = shape
        self.send(header, peer, _SPEC_TAG)

    def recv_spec(self, peer: int) -> tuple[int, tuple[int, ...]]:
        header = self.recv((2 + MAX_DIMS,), np.int64, peer, _SPEC_TAG)
        code, ndim = int(header[0]), int(header[1])
        return (code, tuple(int(d) for d in header[2:2 + max(ndim, 0)])) if code >= 0 else BAD_SPEC

    def exchange_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), on every rank: the p-1 sends and receives each way."""
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        others = [r for r in range(self.size) if r != self.rank]
        for r in others:
            self.send(np.array([payload.size], np.int64), r, _LEN_TAG)
            self.send(payload, r, _OBJ_TAG)
        out = [None] * self.size
        out[self.rank] = obj
        for r in others:
            n = int(self.recv((1,), np.int64, r, _LEN_TAG)[0])
            out[r] = pickle.loads(self.recv((n,), np.uint8, r, _OBJ_TAG).tobytes())
        self.finish()
        return out

    def share(self, value: np.ndarray | None, root: int, shape: tuple, dtype) -> np.ndarray:
        """``root``'s ``value`` on every rank of the set (the step's loss from the last stage)."""
        if self.rank == root:
            for r in range(self.size):
                if r != root:
                    self.send(value, r, _VALUE_TAG)
            self.finish()
            return np.asarray(value)
        return self.recv(shape, dtype, root, _VALUE_TAG)
