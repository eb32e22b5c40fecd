"""``run(func)``: call a training function again, on the survivors, after a rank dies (ULFM).

::

    run(train)(state)
      loop:
        state.sync()                 every rank starts from rank 0's last commit
        train(state)                 ... commit() ... commit() ...   -> return: done
        a peer died (PeerLostError, or ULFM's MPI error) on this rank:
          1. state.restore()         back to this rank's last commit
          2. revoke, shrink          MPI_Comm_revoke on every communicator of the library and
                                     the world (so every survivor stops waiting, wherever it
                                     was), then MPI_Comm_shrink: a new world of the survivors,
                                     the same on every one of them
          3. rebuild                 ar.shutdown(); ar.init(comm=shrunk): a new engine,
                                     negotiation cache, auto's picks, shm windows and mailboxes;
                                     ar.rank(), size(), local_rank(), local_size() are new
          4. reset callbacks         the user re-shards data, rescales the learning rate
          5. (loop) sync from the new rank 0, call train again
        state.commit() raised HostsUpdatedInterrupt (--max-np above the size), on every rank:
          grow (.regrow): spawn replacements, merge them in, rebuild; reset callbacks;
          (loop) sync sends them the commit, call train again
        a wait timed out (TransportTimeoutError): the peer it waited for is silent, not this
          rank: blame it (.heartbeat: the launcher SIGKILLs it), then recover as after a death
        a host went silent (.partition: a cut link): the side with the majority leaves its ranks
          out (MPI_Comm_create_group instead of the shrink) and goes on; the other side stops
        a named allreduce failed with StallError past stall_shutdown_time: blame the ranks that
          never submitted it, the same way
        a rank on this node stops beating for elastic_hang_timeout (.heartbeat's thread): the
          same eviction; the survivors' waits then see a death
        any other Exception on this rank (under --elastic): this rank leaves the job
          (.failure: traceback, one line, exit 1); the others see a death
        a death or a regrow past --reset-limit: every rank stops (.failure, exit 5)

Detection is the transport's (:mod:`allreduce.transport.liveness`): every wait
of the library raises ``PeerLostError`` within ~10 ms of MPI learning of the
death. A second death during recovery (in shrink, in the rebuild) starts the
recovery again from step 2. Below ``--min-np`` every survivor stops with exit
status 3, naming the dead ranks and the last commit. A survivor stuck in one
step (inside MPI) for longer than ``elastic_recovery_timeout`` aborts the job,
naming the step (:mod:`.watchdog`: Open MPI's ULFM over tcp can deadlock).

The new rank 0 writes one ``allreduce-elastic:`` line per recovery to stderr
(which ranks died, when, the new size); ``allreduce-run --elastic`` collects
them into its summary. Each rank is said as every elastic line says one,
``rank 2 of 4 (name 3)``: its rank in the world it died from, and its name (its
rank in the world the job started with, or a replacement's number: :mod:`.world`). The
phases' times of the last recovery are in :data:`last_recovery`
(``benchmarks/elastic_bench.py`` reads them).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

from .. import api, faults
from ..errors import AllreduceError, HostsUpdatedInterrupt
from ..transport.mpi import MPI   # first: it sets the library's Open MPI defaults before MPI_Init
from ..transport.liveness import is_peer_failure, silent_peer
from . import failure, heartbeat, partition, watchdog, world
from .launch import BELOW_MIN_EXIT, MARK, clock, say
from .regrow import grow
from .state import State

__all__ = ["run", "run_with", "last_recovery", "deaths", "BELOW_MIN_EXIT", "MARK", "say", "clock"]

last_recovery: dict[str, float] = {}     #: wall-clock times of the last recovery's phases
deaths = world.deaths                    #: (when noticed, names) for every recovery
_settings: dict[str, Any] = {}           # the library's settings, kept while it is shut down


def run(func: Callable) -> Callable:
    """Decorate ``func(state, *args, **kwargs)`` so it survives the death of ranks (Horovod's ``run``).

    Args:
        func: the training function; its first argument is a :class:`~allreduce.elastic.State`.
            It should call ``state.commit()`` every few steps.

    Returns:
        A function with the same arguments that syncs the state from rank 0, calls ``func``,
        and after a peer's death restores, shrinks, rebuilds, resets and calls it again; after
        a commit that found the world can grow (``--max-np``), spawns replacements first.
    """
    return run_with(func, is_failure=is_peer_failure)


def run_with(func: Callable, *, is_failure: Callable[[BaseException], bool]) -> Callable:
    """:func:`run` with another test of what counts as a peer's death (tfops: TensorFlow's
    wrapping of the library's errors)."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any):
        world.base()
        remember_settings()
        if _elastic():
            heartbeat.start(_bound())
        grow_next = reset_next = False
        while True:
            try:
                if grow_next:
                    grow_next = False
                    remember_settings()
                    failure.check_reset_limit(_settings, state, "a regrow")
                    reset_next = grow(state, _settings, say=say)
                if reset_next:                    # inside the try: a callback may raise, or see a death
                    reset_next = False
                    state.on_reset()
                state.sync()
                world.synced = True           # a replacement has the job's state now (world.joining)
                last_recovery.setdefault("synced", time.time())
                state._in_run = True
                result = func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:         # every rank, at the same commit (state.py)
                grow_next = True
                continue
            except BaseException as exc:  # noqa: BLE001 - a death recovers, an Exception leaves, the rest go up
                if not _elastic():
                    raise                         # allreduce.faults aborts the job
                peer = silent_peer(exc)           # a wait timed out: the silent peer's fault, not ours
                stalled, limit = heartbeat.stalled_ranks(exc)
                if peer is not None:          # unless its host is cut off (then the majority rule decides)
                    partition.settle(_bound())
                    if world.names()[peer: peer + 1] and world.names()[peer] not in partition.unreachable():
                        heartbeat.blame(peer, exc)    # the launcher evicts it; the shrink below waits for that
                elif stalled:
                    heartbeat.blame_stalled(stalled, limit)     # the same, for a tensor never submitted
                elif not is_failure(exc):
                    if isinstance(exc, Exception):
                        failure.leave(exc)        # never returns: the others see a death
                    raise
                caught = time.time()
                remember_settings()
                failure.check_reset_limit(_settings, state, "the death")
                state.restore()
                recover(state, caught)
                reset_next = True
                continue
            finally:
                state._in_run = False
            heartbeat.finish()
            if api.rank() == 0:
                say(f"run({getattr(func, '__name__', 'func')}) finished with {api.size()} ranks "
                    f"(started with {world.start_size()})")
            return result
    return wrapper


def _bound() -> float:
    """Seconds of silence before a rank (or a host) counts as hung: elastic_hang_timeout, else timeout."""
    return _settings.get("elastic_hang_timeout") or _settings.get("timeout", 30.0)


def _elastic() -> bool:
    """Whether this job may shrink (allreduce-run --elastic: ULFM); otherwise a death ends it."""
    if not world.is_start_world():
        return True                          # it has shrunk or grown before
    if api.is_initialized():
        return api.communicator().config.elastic
    return bool(_settings.get("elastic"))    # shut down inside a regrow


def recover(state: State, caught: float) -> None:
    """Steps 2 and 3 of the module doc: revoke, shrink, rebuild (again if another rank dies).
    Each step is bounded by ``elastic_recovery_timeout`` (:mod:`.watchdog`)."""
    remember_settings()
    settings = _settings
    last_recovery.clear()
    last_recovery["caught"] = caught
    while True:
        old = world.base()
        bounded = functools.partial(watchdog.step, timeout=settings.get("elastic_recovery_timeout", 0.0),
                                    who=world.who(), comm=old)
        partition.settle(_bound())
        cut = partition.cut_ranks(world.names())     # ranks of a host cut off (partition.py)
        with bounded("MPI_Comm_revoke"):
            _revoke(old, base=not cut)
        with bounded("the library's shutdown (its engine thread)"):
            _quiet_shutdown()
        if cut:      # MPI_Comm_shrink would wait for them (alive to MPI): this side makes its own world
            with bounded("MPI_Comm_create_group of the ranks this side reaches"):
                new = _without(old, cut)
        else:
            with bounded("MPI_Comm_shrink"):
                new = old.Shrink()
        last_recovery["shrunk"] = time.time()
        group, old_group = new.Get_group(), old.Get_group()
        kept = MPI.Group.Translate_ranks(group, list(range(new.Get_size())), old_group)
        group.Free()
        old_group.Free()
        before = world.names()
        dead = [name for i, name in enumerate(before) if i not in kept]
        gone = world.describe([i for i in range(len(before)) if i not in kept], dead, len(before))
        world.replace(new, [before[i] for i in kept])
        deaths.append((caught, dead))
        if cut:
            world.regrow_failed = True     # a spawn could place a replacement on the host it cannot reach
        if new.Get_size() < settings.get("elastic_min_np", 1):
            _stop(gone, new.Get_size(), settings["elastic_min_np"], state)
        try:
            faults.uninstall()               # it names the rank and size: installed again by init
            with bounded("the rebuild (ar.init on the shrunk world)"):
                api.init(comm=new, **settings)
                world.rebuilt()
        except BaseException as exc:  # noqa: BLE001
            if not is_peer_failure(exc):
                raise
            continue                         # another rank died while we rebuilt: shrink again
        last_recovery["rebuilt"] = time.time()
        last_recovery.pop("synced", None)
        if api.rank() == 0:
            how = ", unreachable: left out, and no regrow" if cut else ""
            say(f"{gone} died (noticed at {clock(caught)} UTC{how}); going on with "
                f"{api.size()} of {world.start_size()} ranks from {state.describe()}; shrink "
                f"{last_recovery['shrunk'] - caught:.3f} s, rebuild "
                f"{last_recovery['rebuilt'] - last_recovery['shrunk']:.3f} s")
        return


def remember_settings() -> None:
    """Keep the library's settings while it is shut down (a rebuild starts it with the same)."""
    global _settings
    if api.is_initialized():
        _settings = dataclasses.asdict(api.communicator().config)


def _without(comm, ranks: list[int]):
    """A communicator of ``comm``'s ranks but ``ranks`` (collective over those kept only)."""
    group = comm.Get_group()
    kept = group.Excl(ranks)
    try:
        return comm.Create_group(kept, tag=45)
    finally:
        kept.Free()
        group.Free()


def _revoke(comm, *, base: bool = True) -> None:
    """Revoke the world (unless ``base`` is False: after a cut, this side builds its own world from
    it) and the library's own communicators: every survivor's pending MPI call, and every wait of
    ours (liveness checks Is_revoked), ends with an error."""
    comms = [comm] if base else []
    if api.is_initialized():
        comms.append(api.communicator().transport.comm)
        engine = api._engine
        if engine is not None:
            comms.append(getattr(engine.transport, "comm", None))
    for comm in comms:
        if comm is None or comm == MPI.COMM_NULL:
            continue
        try:
            comm.Revoke()
        except MPI.Exception:
            pass                                 # already revoked by a peer


def _quiet_shutdown() -> None:
    """``ar.shutdown()`` on a broken world: pending handles fail, nothing collective is freed."""
    try:
        api.shutdown()
    except (AllreduceError, MPI.Exception):
        api._current = api._engine = None


def _stop(gone: str, size: int, min_np: int, state: State) -> None:
    text = (f"below --min-np {min_np}: {gone} died and {size} rank(s) "
            f"are left; the last commit was {state.describe()}; stopping")
    say(text)
    heartbeat.finish()
    world.exit_status = BELOW_MIN_EXIT
    raise SystemExit(BELOW_MIN_EXIT)
