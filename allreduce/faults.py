"""Fail fast and everywhere: what happens when one rank raises.

An uncaught exception on one rank is the most common way a data-parallel job
dies, and the worst way to die is silently: the failing rank exits, its
peers wait forever inside a collective, and ``mpirun`` waits for them (we
measured exactly that hang with plain ``python script.py`` under Open MPI 5).

:func:`install` replaces ``sys.excepthook`` and ``threading.excepthook`` so an
uncaught exception on any rank, in any thread:

1. prints the traceback as usual,
2. prints one line that names the rank: ``allreduce: rank 1 of 4 failed
   with ValueError: ...; aborting the job``,
3. calls ``MPI_Abort``, which makes ``mpirun`` (and ``allreduce-run``)
   terminate every other rank and exit non-zero, instead of a hang or a
   generic "shut down" message on the other ranks.
"""
from __future__ import annotations

import sys
import threading

__all__ = ["install", "uninstall", "abort_job"]

_saved: tuple | None = None


def abort_job(rank: int, size: int, what: str, code: int = 1) -> None:
    """Print who failed and why, then abort every rank of the job."""
    sys.stderr.write(f"allreduce: rank {rank} of {size} failed with {what}; aborting the job "
                     f"so no other rank waits for rank {rank}\n")
    sys.stderr.flush()
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(code)


def install(rank: int, size: int) -> None:
    """Abort the whole job on any uncaught exception (no-op for a single process)."""
    global _saved
    if _saved is not None or size <= 1:
        return
    _saved = (sys.excepthook, threading.excepthook)
    previous_hook, previous_thread_hook = _saved

    def hook(exc_type, exc, tb):
        previous_hook(exc_type, exc, tb)
        if issubclass(exc_type, KeyboardInterrupt):
            abort_job(rank, size, "KeyboardInterrupt", 130)
        abort_job(rank, size, f"{exc_type.__name__}: {exc}")

    def thread_hook(args):
        previous_thread_hook(args)
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread else "?"
        abort_job(rank, size, f"{args.exc_type.__name__} in thread {name!r}: {args.exc_value}")

    sys.excepthook, threading.excepthook = hook, thread_hook


def uninstall() -> None:
    global _saved
    if _saved is not None:
        sys.excepthook, threading.excepthook = _saved
        _saved = None
