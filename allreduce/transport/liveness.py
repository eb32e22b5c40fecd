"""Noticing a dead peer from inside a wait (elastic jobs, ULFM).

Without ``--elastic`` a dead rank ends the job: mpirun terminates the
others. Under ``allreduce-run --elastic`` Open MPI runs with its fault
tolerance (ULFM, ``--with-ft ulfm``) and the survivors carry on, so every
wait of ours must find out by itself that the peer it waits for is gone,
and say so with :class:`~allreduce.errors.PeerLostError` within a bounded
time, instead of waiting out ``ALLREDUCE_TIMEOUT`` (30 s):

* MPI waits (``MPI_Test`` on a request with the dead peer) fail by
  themselves under ULFM: ``MPI_ERR_PROC_FAILED`` on a request with it,
  ``MPI_ERR_REVOKED`` once a survivor revoked the communicator.
  :func:`raise_if_lost` turns those into ``PeerLostError``.
* Our own waits (shared-memory mailboxes, shm flag lines) spin on memory
  that a dead peer never writes again; no MPI call fails there. They call
  :meth:`Liveness.check` from their slow loop, which asks MPI which ranks
  of the communicator it knows have failed::

      every INTERVAL (10 ms) of a slow wait:
          MPI_Iprobe                      drives MPI's progress: the runtime's
                                          failure notice is handled inside it
          MPI_Comm_get_failed -> group    the ranks known dead (a local call)
          /proc/<pid>/stat of each peer   on this host: gone or a zombie
                                          (a second witness: MPI's notice was
                                          once late by more than 30 s)
          MPI_Comm_is_revoked             a survivor already gave up on it
          any of them -> PeerLostError naming the dead ranks

A peer that is alive but silent (stopped, hung) is not dead to MPI: no call
fails, and the waits above end with ``TransportTimeoutError`` after
``ALLREDUCE_TIMEOUT``. :func:`silent_peer` reads which rank such an error
waited for; :data:`wait_hook` lets the elastic layer stamp "this rank is
waiting, not hung" from every check (``allreduce/elastic/heartbeat.py``
evicts the silent one). :attr:`Liveness.peers` is every rank's host, pid
and start time, so a survivor can name the process to evict, and
:attr:`Liveness.beat_ports` the UDP port of every rank's :func:`beat_socket`,
so a heartbeat can cross hosts (``allreduce/elastic/partition.py``). A rank the
elastic layer declares unreachable (its host is cut off: :data:`cut`) is lost
to every wait here as a dead one is, though MPI never hears of it.

Cost: ~0.4 us per check, made only in waits that already lasted past their
spin, at most every 10 ms; none at all without ``--elastic`` (the
transport then has no ``Liveness``). The runtime's notice arrived in
~1 ms after a SIGKILL on one node (by hand, -np 3, Open MPI 5.0.11).
"""
from __future__ import annotations

import os
import re
import socket
import time
from typing import Callable

from mpi4py import MPI   # import allreduce.transport.mpi before this module: it sets Open MPI's defaults

from ..errors import PeerLostError, TransportTimeoutError

__all__ = ["Liveness", "raise_if_lost", "is_peer_failure", "failed_ranks", "silent_peer", "start_time",
           "beat_socket", "cut", "INTERVAL", "wait_hook"]

INTERVAL = 0.01          #: seconds between two checks of one slow wait
_ULFM_CLASSES = frozenset(getattr(MPI, name) for name in
                          ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, name))


#: Called (no arguments) by every check of a slow wait: the elastic heartbeat's "waiting" stamp.
wait_hook: Callable[[], None] | None = None
#: ``rank -> "rank 2 (name 3)"``: how the elastic layer names a rank of the current world (its rank
#: now and its rank in the starting world, allreduce/elastic/world.py); plain ``"rank 2"`` without.
describe_rank: Callable[[int], str] = lambda rank: f"rank {rank}"
#: ``(host, pid, start)`` of processes the elastic layer declared unreachable (a cut link): every
#: wait on a communicator holding one raises ``PeerLostError``, as for a death MPI reported.
cut: set[tuple[str, int, int]] = set()
_beat_socket: socket.socket | None = None
_WAITED_FOR = re.compile(r"waiting (?:to|for) (?:[a-z]+ )*?rank (\d+)")


def silent_peer(exc: BaseException) -> int | None:
    """The rank a ``TransportTimeoutError`` (``exc``, or what it was raised from) waited for; None
    if ``exc`` is no transport timeout. Every wait of the transports names its peer this way."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, TransportTimeoutError):
            match = _WAITED_FOR.search(str(exc))
            return int(match.group(1)) if match else -1
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def beat_socket() -> socket.socket:
    """This process's UDP socket for heartbeats across hosts (bound on first use, any address,
    a port the kernel picks; non-blocking)."""
    global _beat_socket
    if _beat_socket is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        sock.setblocking(False)
        _beat_socket = sock
    return _beat_socket


def start_time(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22):
    with the pid, it names one process for good (a pid alone may be reused). 0 if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is ULFM's word for a dead peer or a revoked communicator (or was raised
    because of one: an engine a peer's death stopped refuses later submits ``from`` it)."""
    if isinstance(exc, PeerLostError) or isinstance(exc.__cause__, PeerLostError):
        return True
    if isinstance(exc, MPI.Exception):
        try:
            return exc.Get_error_class() in _ULFM_CLASSES
        except MPI.Exception:      # noqa: PERF203 - only on the error path
            return False
    return False


def failed_ranks(comm) -> list[int]:
    """The ranks of ``comm`` this process knows have failed (a local call; [] if none)."""
    try:
        group = comm.Get_failed()
    except (MPI.Exception, NotImplementedError):
        return []
    try:
        n = group.Get_size()
        if n == 0:
            return []
        mine = comm.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(n)), mine)
        mine.Free()
        return sorted(r for r in ranks if r is not None and r >= 0)
    finally:
        group.Free()


def _lost(rank: int, dead: list[int], what: str) -> PeerLostError:
    who = ", ".join(map(describe_rank, dead)) if dead else "a peer (the communicator was revoked)"
    error = PeerLostError(f"{describe_rank(rank)}: {who} died while this rank {what}; an elastic job "
                          "(allreduce.elastic.run) restores its last commit and goes on without it")
    error.ranks = dead
    return error


def raise_if_lost(exc: BaseException, comm, rank: int, what: str = "waited for it") -> None:
    """Raise ``PeerLostError`` (from ``exc``) if ``exc`` is ULFM's peer failure, or any MPI error on
    a communicator that lost a rank (``MPI_Testall`` says ``MPI_ERR_IN_STATUS``); return otherwise."""
    if not isinstance(exc, MPI.Exception):
        return
    dead = failed_ranks(comm)
    if is_peer_failure(exc) or dead or _revoked(comm):
        raise _lost(rank, dead, what) from exc


def _revoked(comm) -> bool:
    try:
        return bool(comm.Is_revoked())
    except MPI.Exception:
        return True


class Liveness:
    """The dead-peer check of one communicator (see the module doc)."""

    def __init__(self, comm, rank: int, *, interval: float = INTERVAL):
        """Collective over ``comm`` (an allgather of every rank's host and pid)."""
        self.comm, self.rank, self.interval = comm, rank, interval
        self._next = 0.0
        self.dead: list[int] = []     #: ranks found dead, once found
        # Peers on this host, by pid: a second witness, for when MPI's notice is late (it was
        # once, by more than 30 s, in an engine thread under load: tests/test_elastic.py).
        host = socket.gethostname()
        #: (host, pid, start time) of every rank of the communicator, in rank order
        both = comm.allgather((host, os.getpid(), start_time(os.getpid()), beat_socket().getsockname()[1]))
        self.peers: list[tuple[str, int, int]] = [tuple(p[:3]) for p in both]
        #: the UDP port of every rank's heartbeat socket, in rank order
        self.beat_ports: list[int] = [p[3] for p in both]
        self._pids = [(r, pid) for r, (h, pid, _) in enumerate(self.peers) if h == host and r != rank]

    def check(self, what: str = "waited for a peer") -> None:
        """Raise ``PeerLostError`` if a rank of the communicator is known dead (rate-limited)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        if wait_hook is not None:
            wait_hook()
        self.poll(what)

    def progress(self) -> None:
        """MPI progress for a waiting mailbox, plus the check."""
        self.check("waited in a shared-memory mailbox")

    def poll(self, what: str = "waited for a peer") -> None:
        """The check, now."""
        comm = self.comm
        revoked = False
        try:
            comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        except MPI.Exception as exc:
            if not is_peer_failure(exc):
                raise
            revoked = True
        dead = failed_ranks(comm) or self._gone() or [r for r, p in enumerate(self.peers) if cut and p in cut]
        if dead or revoked or comm.Is_revoked():
            self.dead = dead or self.dead
            raise _lost(self.rank, self.dead, what)

    def _gone(self) -> list[int]:
        """Ranks on this host whose process has ended (no such pid, or a zombie)."""
        gone = []
        for rank, pid in self._pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                if state in (b"Z", b"X"):
                    gone.append(rank)
            except (FileNotFoundError, ProcessLookupError):
                gone.append(rank)
            except (OSError, IndexError):
                pass
        return gone

    def broken(self) -> bool:
        """Whether the communicator lost a rank or was revoked (then no collective free may run on it)."""
        if self.dead:
            return True
        try:
            self.poll()
        except PeerLostError:
            return True
        return False
