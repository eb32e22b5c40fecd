"""Regrow: spawn replacements at a commit, merge them into the world, go on at the larger size.

::

    survivors (size p < --max-np)                          replacements (n = max_np - p)
    state.commit()  save, then HostsUpdatedInterrupt       (not started yet)
    run():  grow(state)
      1. ar.shutdown()          the world is healthy: a normal, collective shutdown
      2. MPI_Comm_spawn(n)  --------------------------->   python train.py (the same command)
                                                           ar.init() joins: merge, news
      3. merge, news            names, start size ---->    (transport/spawn.py, world.py)
      4. ar.init(comm=merged)   <-- collective with -->    ar.init's own setup
         reset callbacks                                   state = ...; train(state) -> run()
      5. (loop) state.sync()    rank 0's commit ------>    state.sync(): the commit
         train(state) again, at size max_np                train(state)

Horovod's counterpart is ``HostsUpdatedInterrupt``: its driver finds new hosts,
``commit()`` raises on every worker, and ``run`` resets and syncs without a
restore (the state was just committed). Here the new processes are started by
MPI itself, on the hosts mpirun was given, so no host discovery is needed.

Cost: the survivors wait for the replacements' start-up (a Python start and
imports, ~1-2 s here) and one sync. A spawn that fails (no free slots:
MPI_Comm_spawn fails on every parent alike) is said once, and the job goes on
at its size without trying again; so does a regrow whose replacement died
before the merge: Open MPI does not report that death to the parents waiting
in MPI_Intercomm_merge, so the watchdog (:mod:`.watchdog`) revokes the
intercommunicator after ``elastic_recovery_timeout`` and the merge fails. The
parents agree (MPI_Comm_agree) that every one of them grew before any goes on
bigger. A parent's death during the regrow is a death like any other: the
agreement raises and ``run`` shrinks the world it had.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

from .. import api, faults
from ..transport.mpi import MPI
from ..transport import spawn
from . import watchdog, world
from .launch import clock
from .state import State

__all__ = ["grow"]

_READY_DEFAULT = 120.0     # seconds to wait for the replacements when the watchdog is off (timeout 0)
_SPAWN_STUCK = "Open MPI did not return from MPI_Comm_spawn (a parent died in it?)"
_MERGE_STUCK = "a replacement died between saying it was ready and the merge"


def grow(state: State, settings: dict[str, Any], *, say: Callable[[str], None]) -> bool:
    """Steps 1-4 of the module doc, on every rank of the current world (collective).

    Returns:
        Whether the world grew (False: the spawn failed, the world is the same, said once).
    """
    comm = world.base()
    size = comm.Get_size()
    count = settings["elastic_max_np"] - size
    names = world.names()
    fresh = world.new_names(count)
    started = time.time()
    api.shutdown()
    faults.uninstall()                   # it names the rank and size: installed again by init
    timeout = settings.get("elastic_recovery_timeout", 0.0)
    bounded = functools.partial(watchdog.step, timeout=timeout, who=world.who(), comm=comm)
    ready, failure = False, None
    try:
        with bounded("MPI_Comm_spawn", why=_SPAWN_STUCK):
            inter = spawn.spawn(comm, count)
        ready = spawn.ready(inter, within=timeout or _READY_DEFAULT)
    except MPI.Exception as exc:
        failure = exc
    # Every parent takes the same turn: the merge only if the spawn worked and every replacement
    # said it was ready on every parent. A parent that died makes the agreement raise: run()
    # shrinks the world it had.
    with bounded("MPI_Comm_agree on the regrow"):
        grown = comm.Agree(int(ready)) == 1
    if not grown:
        world.regrow_failed = True
        api.init(comm=comm, **settings)
        world.rebuilt()
        if api.rank() == 0:
            why = (f"MPI_Comm_spawn: {failure}" if failure is not None else
                   f"a replacement was not ready to join within {timeout or _READY_DEFAULT:g} s: it died "
                   "or is still starting (ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT)")
            say(f"could not spawn {count} replacement(s) ({why}); going on with "
                f"{size} of {world.start_size()} ranks and no more tries")
        return False
    with bounded("MPI_Intercomm_merge with the replacements", why=_MERGE_STUCK):
        merged = spawn.merge(inter, world.news(names + fresh))
    world.replace(merged, names + fresh)
    world.joins.append((started, fresh))
    api.init(comm=merged, **settings)
    world.rebuilt()                      # a replacement's init does the same (tfops: its allgather)
    if api.rank() == 0:
        say(f"{world.describe(list(range(size, size + count)), fresh, size + count)} joined (spawned at {clock(started)} UTC); going on "
            f"with {api.size()} of {world.start_size()} ranks from {state.describe()}; spawn and "
            f"rebuild {time.time() - started:.3f} s")
    return True
