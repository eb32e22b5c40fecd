"""Growing a communicator with new processes: MPI_Comm_spawn + MPI_Intercomm_merge (elastic regrow).

::

    parents (every rank of comm)                 replacements (new processes, the same command)
    grow(comm, n, news)  --- MPI_Comm_spawn --->  MPI_Init (when they import mpi4py)
                                                  ar.init() -> joined_world()
    MPI_Intercomm_merge(high=False)  <------->    MPI_Intercomm_merge(high=True)
    bcast(news) from rank 0          -------->    news: what the job knows (names, sizes)
    -> merged: the parents keep ranks 0..p-1, the replacements are p..p+n-1

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

import sys
from typing import Any

from mpi4py import MPI   # import allreduce.transport.mpi before this module: it sets Open MPI's defaults

__all__ = ["grow", "joined_world", "command"]

_joined: tuple[Any, Any] | None = None     # (communicator, news) of a replacement, once merged


def command() -> tuple[str, list[str]]:
    """The program and arguments of this process: what a replacement runs."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    return sys.executable, argv[1:]


def grow(comm, count: int, news: Any) -> Any:
    """Spawn ``count`` processes running this process's command, merge them into ``comm`` after
    its ranks, and send them ``news`` from rank 0. Collective over ``comm``.

    Args:
        comm: an intracommunicator (every rank of it calls this).
        count: how many processes to add (> 0).
        news: a picklable value every replacement receives (:func:`joined_world`).

    Returns:
        The merged intracommunicator (errors returned, not fatal: ULFM).
    """
    program, args = command()
    inter = comm.Spawn(program, args, maxprocs=count, root=0)
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    merged.bcast(news, 0)
    return merged


def joined_world() -> tuple[Any, Any]:
    """``(COMM_WORLD, None)``, or in a process spawned by :func:`grow` ``(merged, news)``.

    The first call in a replacement merges with its parents (collective with their
    :func:`grow`); later calls return the same pair.
    """
    global _joined
    if _joined is not None:
        return _joined
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return MPI.COMM_WORLD, None
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    _joined = (merged, merged.bcast(None, 0))
    return _joined
