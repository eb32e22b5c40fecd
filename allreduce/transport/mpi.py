"""MPI transport: point-to-point over any mpi4py communicator.

Besides :mod:`allreduce.algorithms.native`, this is the only module that
calls mpi4py's data-moving functions. Every buffer goes out as raw bytes
(``[buf, MPI.BYTE]``: mpi4py counts its bytes), so dtypes MPI has never
heard of, such as bfloat16, travel unchanged.

The transport works on its own duplicate of the communicator, so its
messages can never match a message the application sends on the original.

Waits are bounded. ``MPI_Wait`` blocks forever if a peer stops taking part
(alive, but stuck elsewhere), so every wait here polls ``MPI_Test`` - a
tight spin first, then yielding the core - and raises
``TransportTimeoutError`` naming the peer after ``timeout`` seconds without
completion. A rank that *dies* is handled faster by mpirun itself, which
terminates the job.
"""
from __future__ import annotations

import functools
import os
import time

from ..config import OPEN_MPI_DEFAULTS

# Open MPI reads OMPI_MCA_* from each process's environment when mpi4py initialises MPI, so
# under a plain mpirun the library's defaults apply too (allreduce-run sets the same).
for _name, _value in OPEN_MPI_DEFAULTS.items():
    os.environ.setdefault(_name, _value)



def _bound_mpi_init() -> bool:
    """Under --elastic, end this process if MPI_Init (mpi4py's import) takes longer than
    ``elastic_recovery_timeout``: a replacement whose parent died inside MPI_Comm_spawn waits
    there for good (Open MPI 5.0.11: in ompi_dpm_connect_accept), and mpirun waits for it. A C
    thread (faulthandler) does it: MPI_Init may hold the GIL. It prints this stack and exits 1."""
    import faulthandler
    from ..config import Config
    try:
        config = Config.from_env()
    except (TypeError, ValueError):
        return False                 # init() will say what is wrong with the settings
    if not (config.elastic and config.elastic_recovery_timeout > 0):
        return False
    faulthandler.dump_traceback_later(config.elastic_recovery_timeout, exit=True)
    return True


_INIT_BOUNDED = _bound_mpi_init()
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402  (after the settings above, which MPI_Init reads; stuck here past
#                        elastic_recovery_timeout: a replacement whose spawn failed, see above)
if _INIT_BOUNDED:
    import faulthandler
    faulthandler.cancel_dump_traceback_later()

from ..errors import TransportTimeoutError
from .base import Transport
from .liveness import Liveness, raise_if_lost
from .mailbox import Mailbox
from .spawn import joined_world

__all__ = ["MPITransport"]

SPINS = 2000    # polls (~1 ms) before yielding the core: a small message on one node lands within
                # these. The engine's transport spins far less (ENGINE_SPINS): its waits are often for
                # a peer that is still computing, and spinning there starves the training thread.
ENGINE_SPINS = 100
ENGINE_MAX_PAUSE = 1e-4   # and polls at least every 0.1 ms: a late peer costs at most that much extra


_BYTE = MPI.BYTE                  # a module global: MPI.BYTE is an attribute lookup on every message
_EMPTY = np.empty(0, np.uint8)     # a message with only a head
_ISENDRECV: bool | None = None    # MPI_Isendrecv usable here? Found out by the first transport


def _has_isendrecv() -> bool:
    """MPI-4's MPI_Isendrecv, in mpi4py and in the library (Open MPI 5 has it while it still
    reports MPI 3.1): one exchange with myself on COMM_SELF tells."""
    global _ISENDRECV
    if _ISENDRECV is None:
        try:
            a, b = bytearray(b"x"), bytearray(1)
            MPI.COMM_SELF.Isendrecv([a, MPI.BYTE], 0, 0, [b, MPI.BYTE], 0, 0).Wait()
            _ISENDRECV = b == a
        except (AttributeError, NotImplementedError, MPI.Exception):
            _ISENDRECV = False
    return _ISENDRECV


class _Request:
    """A pending transfer: the raw MPI request plus who it is with (for the timeout message)."""

    __slots__ = ("raw", "transport", "peer", "kind")

    def __init__(self, raw: MPI.Request, transport: "MPITransport", peer: int, kind: str):
        self.raw, self.transport, self.peer, self.kind = raw, transport, peer, kind

    def wait(self) -> None:
        raw = self.raw
        try:                                   # free until it raises (Python 3.11's zero-cost try)
            for _ in range(self.transport.spins):
                if raw.Test():
                    return
            self.transport._wait_slow(raw.Test, [self])
        except MPI.Exception as exc:           # ULFM (--elastic): a dead peer, a revoked communicator
            raise_if_lost(exc, self.transport.comm, self.transport.rank)
            raise


class MPITransport(Transport):
    """Point-to-point messaging over ``comm`` (default ``COMM_WORLD``)."""

    def __init__(self, comm: MPI.Comm | None = None, *, dup: bool = True, timeout: float = 30.0,
                 spins: int = SPINS, max_pause: float = 1e-3, mailbox: bool = False, elastic: bool = False):
        """``mailbox``: carry small :meth:`exchange` calls through shared memory where every rank
        shares one node (:mod:`allreduce.transport.mailbox`; collective: built here, at once).
        ``elastic``: waits notice a dead peer and raise ``PeerLostError`` (:mod:`.liveness`; ULFM)."""
        if comm is None:   # an elastic job's replacement starts from the world it joined (spawn.py)
            comm = joined_world()[0] if elastic else MPI.COMM_WORLD
        base = comm
        self.comm = base.Dup() if dup else base
        self._owned = dup
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = timeout
        self.spins = spins
        self.max_pause = max_pause        # the longest sleep between polls once the spin is over
        self._isendrecv = _has_isendrecv()
        self.liveness = Liveness(self.comm, self.rank) if elastic else None
        self.mailbox = Mailbox.create(self.comm, timeout=timeout, spins=spins, alive=self.liveness) \
            if mailbox else None

    def _wait_slow(self, done, requests) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        alive = self.liveness
        while not done():
            if alive is not None:
                alive.check()                 # --elastic: a dead peer raises PeerLostError (liveness.py)
            if time.monotonic() > deadline:
                stuck = [r for r in requests if not r.raw.Test()] or requests
                peers = ", ".join(f"{r.kind} rank {r.peer}" for r in stuck[:4])
                raise TransportTimeoutError(
                    f"rank {self.rank}: no progress for {self.timeout:g} s waiting to {peers}; "
                    "that rank is stuck or not calling the same collective "
                    "(raise ALLREDUCE_TIMEOUT if it is just slow)")
            time.sleep(pause)                 # sleep(0) yields the core to an oversubscribed peer
            pause = min(pause * 2 or 1e-5, self.max_pause)

    def isend(self, buf, dest, tag=0):
        try:
            return _Request(self.comm.Isend([buf, _BYTE], dest, tag), self, dest, "send to")
        except MPI.Exception as exc:           # ULFM: the communicator was revoked
            raise_if_lost(exc, self.comm, self.rank)
            raise

    def irecv(self, buf, source, tag=0):
        try:
            return _Request(self.comm.Irecv([buf, _BYTE], source, tag), self, source,
                            "receive from")
        except MPI.Exception as exc:
            raise_if_lost(exc, self.comm, self.rank)
            raise

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        # The latency path (rd, the last steps of rhd): one MPI-4 MPI_Isendrecv where the library
        # has it (one call and one request instead of two: ~0.5 us of a ~5 us exchange), and
        # request objects for the timeout message only if the spin runs out.
        try:
            comm = self.comm
            if self._isendrecv:
                raw = comm.Isendrecv([sendbuf, _BYTE], dest, tag, [recvbuf, _BYTE], source, tag)
                test = raw.Test
                for _ in range(self.spins):               # spun here, not in _wait_raw: a call and a
                    if test():                            # closure cost ~0.4 us of a ~1.5 us exchange
                        return
                self._wait_slow(test, [_Request(raw, self, source, "receive from"), _Request(raw, self, dest, "send to")])
                return
            raws = [comm.Irecv([recvbuf, _BYTE], source, tag), comm.Isend([sendbuf, _BYTE], dest, tag)]
            self._wait_raw(raws, lambda: [_Request(raws[0], self, source, "receive from"),
                                          _Request(raws[1], self, dest, "send to")])
        except MPI.Exception as exc:           # ULFM (--elastic): a dead peer, a revoked communicator
            raise_if_lost(exc, self.comm, self.rank)
            raise

    def exchange(self, sendbuf, recvbuf, peer, tag=0):
        # Each direction by its own size: a small one through the mailbox, a large one on MPI.
        box = self.mailbox
        if box is not None:
            limit = box.limit
            if sendbuf.nbytes <= limit:
                if recvbuf.nbytes <= limit:
                    box.put(sendbuf, peer)
                    box.take(recvbuf, peer)
                    return
                request = self.irecv(recvbuf, peer, tag)
                box.put(sendbuf, peer)
                request.wait()
                return
            if recvbuf.nbytes <= limit:
                request = self.isend(sendbuf, peer, tag)
                box.take(recvbuf, peer)
                request.wait()
                return
        self.sendrecv(sendbuf, peer, recvbuf, peer, tag)

    def exchange_head(self, head, peer, tag):
        box = self.mailbox
        if box is None:
            return super().exchange_head(head, peer, tag)
        box.put(_EMPTY, peer, head)             # no data: the integers ride in the counter's line
        theirs = box.peek(peer)
        box.skip(peer)
        return theirs

    def wait_all(self, requests):
        self._wait_raw([r.raw for r in requests], lambda: requests)

    def _wait_raw(self, raws, described) -> None:
        """Spin on ``Testall``, then the bounded slow wait; ``described()`` names the requests for
        the timeout message (built only then)."""
        test = raws[0].Test if len(raws) == 1 else functools.partial(MPI.Request.Testall, raws)
        try:
            for _ in range(self.spins):
                if test():
                    return
            self._wait_slow(test, described())
        except MPI.Exception as exc:           # ULFM (--elastic): a dead peer, a revoked communicator
            raise_if_lost(exc, self.comm, self.rank)
            raise

    def barrier(self) -> None:
        request = _Request(self.comm.Ibarrier(), self, -1, "barrier with")
        request.wait()

    def close(self) -> None:
        if self.liveness is not None and self.liveness.broken():
            # A rank died: freeing is collective and would wait for it. Leave the window and the
            # communicator to MPI_Finalize (elastic recovery builds new ones: allreduce/elastic/).
            self.mailbox, self._owned = None, False
            return
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
        if self._owned and self.comm != MPI.COMM_NULL:
            self.comm.Free()
            self._owned = False
