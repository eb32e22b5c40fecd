"""What an elastic job knows about its world as it shrinks and grows: one record per process.

::

    start  -np 4       names [0, 1, 2, 3]           base: COMM_WORLD
    rank 2 dies        names [0, 1, 3]              base: MPI_Comm_shrink(base)
    regrow --max-np 4  names [0, 1, 3, 4]           base: spawn + merge (transport/spawn.py)

A process is named by its rank in the world the job started with; a
replacement by the next unused number (4 above), so a name is never reused
and the launcher's summary can say who died and who joined. ``names[i]`` is
the name of rank ``i`` of ``base``, the same list on every rank; a replacement
receives it, with the rest of :func:`news`, when it joins.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Callable

from ..transport.mpi import MPI   # first: it sets the library's Open MPI defaults before MPI_Init
from ..transport.spawn import joined_world

__all__ = ["base", "names", "name", "who", "describe", "start_size", "news", "replace", "leave_without_finalize",
           "exit_status", "deaths", "joins", "resets", "rebuild_hooks", "rebuilt", "joining", "synced"]

deaths: list[tuple[float, list[int]]] = []   #: (when noticed, names) for every shrink
joins: list[tuple[float, list[int]]] = []    #: (when joined, names) for every regrow
regrow_failed = False             #: a spawn failed once: the job goes on at its size, no more tries
resets = 0                        #: shrinks and regrows so far (the reset limit counts them: failure.py)
synced = False                    #: run() has synced a state here (a replacement: the job's state arrived)
exit_status = 0                   #: the status a process that left without MPI_Finalize ends with
#: Called on every rank after the library was rebuilt on a new world (shrunk or grown), in order:
#: a layer above redoes what its own init does collectively after ``ar.init()`` (tfops: the
#: layout allgather), as a replacement's init does it, so the two sides stay in step.
rebuild_hooks: list[Callable[[], None]] = []

_base = None
_names: list[int] = []
_start_size = 0
_next_name = 0


def base():
    """The communicator the library runs on and a recovery shrinks (set up on first use)."""
    global _base, _names, _start_size, _next_name, regrow_failed, resets
    if _base is None:
        comm, told = joined_world()
        _base = comm
        if told is None:                   # a process the job started with
            _names = list(range(comm.Get_size()))
            _start_size = _next_name = comm.Get_size()
        else:                              # a replacement: its parents told it the rest
            _names, _start_size, _next_name = told["names"], told["start_size"], told["next_name"]
            regrow_failed, resets = told["regrow_failed"], told["resets"]
            joins.extend(told["joins"])
            leave_without_finalize()
    return _base


def names() -> list[int]:
    """The name of every rank of :func:`base`, in rank order."""
    base()
    return list(_names)


def name() -> int:
    """This process's name: its rank in the starting world, or its replacement number."""
    comm = base()
    return _names[comm.Get_rank()]


def who(rank: int | None = None) -> str:
    """``rank 2 of 4 (name 3)``: a rank of the current world as every elastic line says it (this
    process's own without ``rank``): its rank now, which changes as the world does, and its name."""
    comm = base()
    rank = comm.Get_rank() if rank is None else rank
    named = _names[rank] if 0 <= rank < len(_names) else "?"
    return f"rank {rank} of {len(_names)} (name {named})"


def describe(ranks: list[int], names_of_ranks: list[int], size: int) -> str:
    """``rank 1 of 4 (name 1), rank 3 of 4 (name 3)``: ranks of a world of ``size`` (the one they
    died from, or joined), each said as :func:`who` says one; ``names_of_ranks[i]`` names ``ranks[i]``."""
    return ", ".join(f"rank {r} of {size} (name {n})" for r, n in zip(ranks, names_of_ranks))


def start_size() -> int:
    base()
    return _start_size


def joining() -> bool:
    """Whether this process is a replacement whose state has not arrived yet (before the first
    sync of :func:`~allreduce.elastic.run`). Its peers set their models up before it existed, so
    a setup that is a collective elsewhere (tfops.fully_shard's model check and weight broadcast)
    runs alone here and the sync brings the values. False outside ``--elastic`` (MPI untouched)."""
    from .. import api
    if synced or not api.is_initialized() or not api.communicator().config.elastic:
        return False
    return name() >= start_size()


def is_start_world() -> bool:
    """Whether the job still runs on the world it started with (it never shrank or grew)."""
    return base() is MPI.COMM_WORLD


def new_names(count: int) -> list[int]:
    """Names for ``count`` replacements (the same on every rank: the counter moves alike)."""
    global _next_name
    base()
    fresh = list(range(_next_name, _next_name + count))
    _next_name += count
    return fresh


def news(names_after: list[int]) -> dict[str, Any]:
    """What a replacement must be told when it joins (:func:`base` reads it there)."""
    return {"names": names_after, "start_size": _start_size, "next_name": _next_name,
            "regrow_failed": regrow_failed, "joins": list(joins),
            "resets": resets + 1}             # counting the regrow that brings it in


def replace(comm, names_of_ranks: list[int]) -> None:
    """The job goes on on ``comm`` (shrunk or grown), whose rank ``i`` is named ``names_of_ranks[i]``:
    one reset more."""
    global _base, _names, resets
    _base, _names = comm, list(names_of_ranks)
    resets += 1
    leave_without_finalize()


def rebuilt() -> None:
    """Run :data:`rebuild_hooks` (collective: every rank of the new world)."""
    for hook in rebuild_hooks:
        hook()


_leaving = False


def leave_without_finalize() -> None:
    """End this process without MPI_Finalize (at exit), once it shrank, grew or joined a world."""
    global _leaving
    if not _leaving:
        _leaving = True
        atexit.register(_exit_without_finalize)    # after mpi4py's: atexit runs it first


def _exit_without_finalize() -> None:
    """Finalizing with revoked communicators and their shared windows hung now and then, and in a
    world grown by MPI_Comm_spawn it crashed in Open MPI's disconnect (5.0.11: a segfault in
    ompi_dpm_dyn_finalize, docs/11); a rank that finished its work has nothing left to say to MPI.
    Its buffered output is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status)
