"""Growing a communicator with new processes: MPI_Comm_spawn + MPI_Intercomm_merge (elastic regrow).

::

    parents (every rank of comm)                 replacements (new processes, the same command)
    spawn(comm, n)  ----- MPI_Comm_spawn ------>  MPI_Init (when they import mpi4py)
                                                  ar.init() -> joined_world()
    ready(inter, within=s)  <----------------->   "ready" to every parent (Isend, intercomm)
    (the caller: MPI_Comm_agree, all ready?)
    merge(inter, news):
    MPI_Intercomm_merge(high=False)  <------->    MPI_Intercomm_merge(high=True)
    bcast(news) from rank 0          -------->    news: what the job knows (names, sizes)
    -> merged: the parents keep ranks 0..p-1, the replacements are p..p+n-1

Why the "ready" message: a replacement that dies before the merge is never
reported to parents waiting in MPI_Intercomm_merge (Open MPI 5.0.11 under
ULFM: they waited there for good, and revoking the intercommunicator did not
free them). Waiting for "ready" is a loop of ours, with a deadline, so the
parents can give up and go on at their size. A replacement whose parents gave
up (or whose merge does not finish within its own bound) says so and exits.

The replacements run the command this process was started with
(``sys.executable`` and ``sys.orig_argv``), so a training script is its own
replacement; their environment is the job's (mpirun's ``-x`` variables reach
spawned processes too, ``ALLREDUCE_ELASTIC`` among them). An elastic job's
transport (:class:`~allreduce.transport.mpi.MPITransport` with ``elastic=True``
and no communicator) starts from :func:`joined_world`: ``COMM_WORLD``, or in a
replacement the merged communicator.

Cost: the parents wait in MPI_Comm_spawn for the new processes' MPI_Init and in
the merge for their ``ar.init()``: a Python start and its imports (~1-2 s here;
seconds more with TensorFlow). On one host the spawned processes need free
slots: ``allreduce-run --elastic`` passes ``--oversubscribe`` when ``--max-np`` is
more than the cores; without slots MPI_Comm_spawn fails on every parent alike
("All nodes which are allocated for this job are already filled").
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any

from mpi4py import MPI   # import allreduce.transport.mpi before this module: it sets Open MPI's defaults

__all__ = ["spawn", "ready", "merge", "joined_world", "command", "READY_TAG"]

READY_TAG = 7301      #: a replacement's "ready to merge" message to each parent (on the intercommunicator)
READY_POLL = 0.01     #: seconds between two looks at the ready messages

_joined: tuple[Any, Any] | None = None     # (communicator, news) of a replacement, once merged


def command() -> tuple[str, list[str]]:
    """The program and arguments of this process: what a replacement runs."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    return sys.executable, argv[1:]


def spawn(comm, count: int) -> Any:
    """Spawn ``count`` processes running this process's command (collective over ``comm``, an
    intracommunicator); return the intercommunicator to them (errors returned: ULFM)."""
    program, args = command()
    inter = comm.Spawn(program, args, maxprocs=count, root=0)
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    return inter


def ready(inter, *, within: float) -> bool:
    """Whether every replacement said it is ready to merge within ``within`` seconds.

    False means one did not (it died before the merge, or is still starting): Open MPI does
    not report such a death to a parent waiting in MPI_Intercomm_merge, which would wait
    forever. The parents may disagree at the deadline; the caller agrees (MPI_Comm_agree)
    before :func:`merge`.
    """
    count = inter.Get_remote_size()
    flags = [bytearray(1) for _ in range(count)]
    requests = [inter.Irecv(flags[i], source=i, tag=READY_TAG) for i in range(count)]
    deadline = time.monotonic() + within
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            for request in requests:
                with contextlib.suppress(MPI.Exception):
                    request.Cancel()
            return False
        time.sleep(READY_POLL)
    return True


def merge(inter, news: Any) -> Any:
    """Merge the replacements in after the ranks of ``comm`` and send them ``news`` from rank 0.

    Returns:
        The merged intracommunicator (errors returned, not fatal: ULFM).
    """
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    merged.bcast(news, 0)
    return merged


def joined_world(*, timeout: float | None = None) -> tuple[Any, Any]:
    """``(COMM_WORLD, None)``, or in a process spawned by :func:`grow` ``(merged, news)``.

    The first call in a replacement merges with its parents (collective with their
    :func:`grow`); later calls return the same pair. A replacement whose merge fails, or
    has not finished within ``timeout`` seconds (default: ``elastic_recovery_timeout``, the
    parents' own bound, or 60 s when that is 0; its parents gave up on it), says so on stderr
    and exits with status 1.
    """
    global _joined
    if _joined is not None:
        return _joined
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return MPI.COMM_WORLD, None
    if timeout is None:
        from ..config import Config
        timeout = Config.from_env().elastic_recovery_timeout or 60.0
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    ready = [parent.Isend(b"1", dest, tag=READY_TAG) for dest in range(parent.Get_remote_size())]
    late = threading.Timer(timeout, _leave, (f"its parents did not merge with it within {timeout:g} s",))
    late.daemon = True
    late.start()                  # the parents merge as soon as every replacement said ready
    try:
        merged = parent.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        _joined = (merged, merged.bcast(None, 0))
        MPI.Request.Waitall(ready)
    except MPI.Exception as exc:  # one of the parents died
        _leave(f"MPI_Intercomm_merge with its parents failed ({exc})")
    finally:
        late.cancel()
    return _joined


def _leave(why: str) -> None:
    """A replacement that cannot join ends at once (no MPI_Finalize: its parents are gone from it)."""
    os.write(2, f"allreduce-elastic: a replacement (pid {os.getpid()}) could not join: {why}; "
                f"exiting\n".encode())
    os._exit(1)
