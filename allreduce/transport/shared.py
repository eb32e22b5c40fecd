"""Shared segments: memory every rank of a transport can read and write directly.

Point-to-point messages copy data twice (into a message, out of it). Ranks on
one machine can skip that: each rank owns a *region* of one shared segment,
writes its data there, and reads its peers' regions in place. Algorithm
``shm`` is built on this; ``hierarchical`` uses it inside each node.

::

    region of rank 0           region of rank 1          ...   region of rank p-1
    +------+---------------+   +------+---------------+        +------+---------------+
    | flag | data (nbytes) |   | flag | data (nbytes) |        | flag | data (nbytes) |
    +------+---------------+   +------+---------------+        +------+---------------+
      ^ a 64-byte line (flag, round count, the call's tag): spinning on it never touches a
        data cache line

A flag is a counter only its owner writes. ``post()`` says "everything I
wrote before this is visible: I am at step ``seq``"; ``wait(j, value)`` spins
until rank j's flag reaches ``value``. That is the whole synchronisation
vocabulary; the algorithm decides which waits make which reuse safe.

Two implementations, one interface (:class:`SharedSegment`):

* MPI: ``MPI.Win.Allocate_shared`` on the ``COMM_TYPE_SHARED`` split of the
  transport's communicator, in one passive epoch (``Lock_all``); ``Win.Sync``
  is the memory fence around every flag write and after every flag read.
  Waits spin, then ``os.sched_yield()``, then sleep, so oversubscribed ranks
  (more ranks than cores) hand the core to the peer they wait for.
* threads: one numpy array shared by the thread ranks; waits sleep on a
  condition variable (a spinning thread would hold the GIL its peer needs).

:func:`attach` builds the segment on first use and caches it on the
transport, so later calls reuse it: allocation is collective on MPI, and
every rank makes the same calls in the same order, so every rank allocates
together.

Registered buffers. :func:`allocate` builds a segment for the caller's own
data instead (``Communicator.shared_empty``: an array whose memory every rank
of the node can read, as NCCL's ``ncclMemAlloc`` with buffer registration,
PyTorch's symmetric memory, or ``MPI_Win_allocate_shared``). An algorithm
given such an array finds it with :func:`find` and reads the peers' copies
in place, skipping the copy into a segment. Each allocation is its own
segment with its own flags, so the k-th allocation of every rank belongs
together.
"""
from __future__ import annotations

import os
import threading
import time
import weakref

import numpy as np

from ..errors import PeerLostError, TransportError, TransportTimeoutError

__all__ = ["SharedSegment", "attach", "allocate", "find", "window_bytes", "WAIT_TIMEOUT", "WINDOW_BYTES",
           "WINDOW_BYTES_OVERSUBSCRIBED"]

#: A streaming algorithm's window per rank when every rank of the node has a core: the segment
#: (two halves of the window per rank) stays in the last-level cache next to the inputs.
WINDOW_BYTES = 2 << 20
#: ... and when the node runs more ranks than cores: a flag hand-off can then cost a scheduler
#: time slice, so each window carries milliseconds of work.
WINDOW_BYTES_OVERSUBSCRIBED = 4 << 20
WAIT_TIMEOUT = 60.0      #: seconds a wait may take, when the transport has no ``timeout`` of its own
_LINE = 64               #: flag line: one cache line
_PAGE = 4096             #: data starts page-aligned, so every dtype view is aligned
_SPINS = 100             #: tight polls first: an unloaded peer is usually a few microseconds away
_YIELDS = 2000           #: then sched_yield polls: an oversubscribed peer needs this core to get there
_SLEEP = 50e-6           #: then sleep between polls, so a long wait costs no CPU
_CORES = os.cpu_count() or 1   #: the machine's CPUs, read once (os.cpu_count costs ~6 us a call)

_FLAG_WORDS = 5          #: per flag line: seq, round count, and the current call's tag (three words)
_cache: "weakref.WeakKeyDictionary[object, dict[int, SharedSegment]]" = weakref.WeakKeyDictionary()
_buffers: "weakref.WeakKeyDictionary[object, list[tuple[int, int, SharedSegment]]]" = weakref.WeakKeyDictionary()
_thread_states: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_registered = False      #: set by the first allocate(): until then find() answers at once
_roots: set[int] = set()  #: id() of the object owning each registered region's memory: find()'s quick filter
_lock = threading.Lock()


class SharedSegment:
    """This rank's handle on a shared segment of ``size`` regions of ``nbytes`` each.

    Attributes:
        rank, size: this rank and the number of ranks sharing the segment.
        regions: ``size`` uint8 arrays of ``nbytes``: region j belongs to rank j.
        seq: the last value this rank posted.
    """

    def __init__(self, rank: int, size: int, regions: list[np.ndarray], flags: list[np.ndarray],
                 timeout: float):
        self.rank, self.size, self.regions, self._flags = rank, size, regions, flags
        self.timeout = timeout
        self.seq = int(flags[rank][0])   # resume where a previous handle of this rank stopped
        self.broken: str | None = None
        self._alive = None               # --elastic: the transport's Liveness (dead peers raise)
        # More ranks than cores: the peer we wait for needs our core, so stop polling sooner.
        self._yields = _YIELDS if size <= _CORES else _SPINS + 20

    def next_round(self) -> int:
        """Count one more round of the algorithm; returns 0 or 1 alternately (which half to use).

        Every rank counts the same rounds, so all agree without talking. The
        count lives next to the flag, so a new handle on the same segment resumes it.
        """
        count = self._flags[self.rank][1:2]
        parity = int(count[0]) & 1
        count[0] += 1
        return parity

    def data(self, rank: int, dtype, count: int, offset: int = 0) -> np.ndarray:
        """``count`` elements of ``dtype`` from rank ``rank``'s region, starting at element ``offset``."""
        dtype = np.dtype(dtype)
        return self.regions[rank][offset * dtype.itemsize:(offset + count) * dtype.itemsize].view(dtype)

    def set_tag(self, *words: int) -> None:
        """Describe the call this rank is in (up to three integers), for peers to compare after
        they see its next post: a registered buffer's offset, count and dtype."""
        self._flags[self.rank][2:2 + len(words)] = words

    def tag(self, rank: int) -> tuple[int, ...]:
        """The tag rank ``rank`` set before its latest post (read it after waiting for that post)."""
        return tuple(int(w) for w in self._flags[rank][2:_FLAG_WORDS])

    def post(self) -> int:
        """Publish everything written so far and advance this rank's flag; returns the new value."""
        self.seq += 1
        self._fence()
        self._flags[self.rank][0] = self.seq
        self._fence()
        self._notify()
        return self.seq

    def wait(self, rank: int, value: int) -> None:
        """Return once rank ``rank`` has posted ``value`` (its writes before that post are then visible)."""
        flag = self._flags[rank]
        if flag[0] < value:
            self._wait_slow(flag, rank, value)
        self._fence()

    def check_usable(self) -> None:
        """Raise if an earlier call failed midway: peers' flags no longer line up with ours."""
        if self.broken:
            raise TransportError(f"rank {self.rank}: shared segment unusable after an earlier failure "
                                 f"({self.broken}); restart the job")

    # -- implementation hooks ------------------------------------------------------------
    def _fence(self) -> None:
        """A full memory barrier (release before a flag write, acquire after a flag read)."""

    def _notify(self) -> None:
        """Wake peers sleeping in :meth:`wait` (threads)."""

    def _wait_slow(self, flag: np.ndarray, rank: int, value: int) -> None:
        deadline = time.monotonic() + self.timeout
        polls = 0
        while flag[0] < value:
            polls += 1
            if polls < _SPINS:
                continue
            if polls < self._yields:
                os.sched_yield()
                continue
            time.sleep(_SLEEP)
            if self._alive is not None:
                self._check_alive(rank)
            if time.monotonic() > deadline:
                self._timeout(rank, value)

    def _check_alive(self, rank: int) -> None:
        try:
            self._alive.check(f"waited for rank {rank} in a shared segment")
        except PeerLostError as exc:
            self.broken = str(exc)
            raise

    def _timeout(self, rank: int, value: int) -> None:
        self.broken = f"timed out waiting for rank {rank}"
        raise TransportTimeoutError(f"rank {self.rank}: timed out after {self.timeout:g} s waiting for "
                                    f"rank {rank} to reach step {value} of the shared segment (it is at "
                                    f"{int(self._flags[rank][0])}); did every rank make the same call?")


class _MPISegment(SharedSegment):
    def __init__(self, comm, nbytes: int, timeout: float):
        from mpi4py import MPI
        self._MPI = MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        if node.Get_size() != comm.Get_size():
            sizes = node.Get_size(), comm.Get_size()
            node.Free()
            raise ValueError(f"shared memory needs every rank on one node, but only {sizes[0]} of "
                             f"{sizes[1]} ranks share this rank's node; use algorithm 'hierarchical'")
        stride = _PAGE + -(-nbytes // _PAGE) * _PAGE
        self._win = MPI.Win.Allocate_shared(stride, 1, comm=node)
        self._win.Lock_all(MPI.MODE_NOCHECK)    # one passive epoch for the segment's lifetime: Sync needs it
        self._node = node
        size, rank = node.Get_size(), node.Get_rank()
        regions, flags = [], []
        for j in range(size):
            mem, _ = self._win.Shared_query(j)
            whole = np.frombuffer(mem, dtype=np.uint8, count=stride)
            flags.append(whole[:_LINE].view(np.int64)[:_FLAG_WORDS])
            regions.append(whole[_PAGE:_PAGE + nbytes])
        flags[rank][:] = 0
        node.Barrier()                          # every flag is zeroed before anyone reads one
        super().__init__(rank, size, regions, flags, timeout)

    def _fence(self) -> None:
        self._win.Sync()


class _ThreadSegment(SharedSegment):
    def __init__(self, rank: int, state: dict, timeout: float, world):
        self._cond, self._world = state["cond"], world
        super().__init__(rank, state["size"], state["regions"], state["flags"], timeout)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait_slow(self, flag, rank, value) -> None:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while flag[0] < value:
                failed = getattr(self._world, "failed", None)
                if failed is not None and failed[0] != self.rank:
                    self.broken = f"peer rank {failed[0]} failed"
                    raise PeerLostError(f"rank {self.rank}: peer rank {failed[0]} failed while this rank "
                                        f"waited for rank {rank} in the shared segment")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._timeout(rank, value)
                self._cond.wait(min(left, 0.2))


def _thread_state(world, members: tuple, nbytes: int, key=None) -> dict:
    """The arrays all thread ranks of ``members`` share (built by whichever rank comes first)."""
    with _lock:
        states = _thread_states.setdefault(world, {})
        key = (members, nbytes) if key is None else (members, nbytes, key)
        if key not in states:
            size = len(members)
            states[key] = {"size": size, "cond": threading.Condition(),
                           "regions": [np.zeros(nbytes, np.uint8) for _ in range(size)],
                           "flags": [np.zeros(_LINE // 8, np.int64)[:_FLAG_WORDS] for _ in range(size)]}
        return states[key]


def window_bytes(nranks: int, cores: int | None = None) -> int:
    """The default window per rank for ``nranks`` ranks sharing one machine of ``cores`` CPUs.

    Every rank of the node computes the same value (``os.cpu_count()`` counts the machine's CPUs,
    not the ones a rank is bound to), so every rank cuts a buffer into the same windows.
    On the 2-core development VM, by hand, in one launch each: at -np 2, 4 MiB and 16 MiB
    allreduces ran 1.3-1.6x faster with 2 MiB windows than with 4 MiB ones (the two ranks'
    inputs, outputs and 4 MiB segments then fit the 32 MiB L3); at -np 4, oversubscribed,
    4 MiB windows ran 1.2-2x faster than 2 MiB ones.
    """
    cores = _CORES if cores is None else cores
    return WINDOW_BYTES_OVERSUBSCRIBED if nranks > cores else WINDOW_BYTES


def attach(comm, nbytes: int) -> SharedSegment:
    """This rank's handle on the segment of ``nbytes`` per rank for transport ``comm``.

    Built on the first call (collectively, on MPI) and cached on ``comm``.

    Args:
        comm: an ``MPITransport`` on one node, a ``ThreadTransport``, or a
            thread group from :mod:`allreduce.algorithms.hierarchical`.
        nbytes: bytes of data per rank.

    Returns:
        A :class:`SharedSegment`; its ``regions`` have ``nbytes`` bytes each.

    Raises:
        ValueError: the transport offers no shared memory, or its ranks span nodes.
    """
    per_comm = _cache.setdefault(comm, {})
    seg = per_comm.get(nbytes)
    if seg is None:
        seg = per_comm[nbytes] = _build(comm, nbytes)
    seg.check_usable()
    return seg


def _build(comm, nbytes: int, key=None) -> SharedSegment:
    world = getattr(comm, "world", None)
    if world is not None:
        members = tuple(getattr(comm, "members", range(comm.size)))
        state = _thread_state(world, members, nbytes, key)
        return _ThreadSegment(comm.rank, state, getattr(world, "timeout", WAIT_TIMEOUT), world)
    if hasattr(comm, "comm"):
        seg = _MPISegment(comm.comm, nbytes, getattr(comm, "timeout", WAIT_TIMEOUT))
        seg._alive = getattr(comm, "liveness", None)
        return seg
    raise ValueError(f"{type(comm).__name__} offers no shared memory: shared-memory algorithms "
                     "need the MPI transport or the in-process thread transport")


def allocate(comm, nbytes: int) -> SharedSegment:
    """A new segment of ``nbytes`` per rank for the caller's own data (a registered buffer).

    Collective: every rank of ``comm`` calls it, in the same order, with the same ``nbytes``.
    Like :func:`attach`'s segments it is freed only when MPI finalizes; :func:`find` knows it
    from now on.

    Raises:
        ValueError: as :func:`attach`.
    """
    global _registered
    known = _buffers.setdefault(comm, [])
    seg = _build(comm, max(int(nbytes), 1), key=("buffer", len(known)))
    mine = seg.regions[seg.rank]
    _roots.add(id(_root(mine)))
    _registered = True
    known.append((mine.ctypes.data, mine.nbytes, seg))
    return seg


def find(comm, array: np.ndarray) -> tuple[SharedSegment, int] | None:
    """``(segment, byte offset)`` if ``array`` (contiguous) lies in this rank's region of a segment
    :func:`allocate` made for ``comm``; None otherwise (and at once when there is none)."""
    if not _registered or id(_root(array)) not in _roots:
        return None          # ~0.2 us; array.ctypes.data below costs ~1.5 us
    known = _buffers.get(comm)
    if not known:
        return None
    start = array.ctypes.data
    for base, size, seg in known:
        if base <= start and start + array.nbytes <= base + size:
            return seg, start - base
    return None


def _root(array):
    """The object at the bottom of ``array``'s chain of views: what owns its memory."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array
