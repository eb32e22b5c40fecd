"""Process sets: collectives over a subset of the ranks, each set on an MPI sub-communicator.

::

    import allreduce as ar
    from allreduce.process_sets import add_process_set, global_process_set
    ar.init()
    evens = add_process_set(range(0, ar.size(), 2))   # collective: every rank calls it
    if evens.included():
        y = evens.communicator.allreduce(x)           # averaged over the even ranks only

Horovod's semantics (``horovod/common/process_sets.py``): :func:`add_process_set`
and :func:`remove_process_set` are collective over *all* ranks, in the same
order, with the same ranks; a set's ranks are kept sorted (an empty set, or one of
every rank, is allowed; the same ranks twice are not); ``ps.size()`` is
known everywhere, ``ps.rank()`` only on its members; a rank outside the set
that calls one of its collectives gets an error at once (it has nothing to
take part in). ``global_process_set`` (id 0) is every rank.

Design: each set gets its own :class:`~allreduce.comm.Communicator` over its own
MPI communicator (``MPI_Comm_create_group``, collective over the members
only), so its messages can never match another set's or the world's, and
every algorithm, check and error of the world path applies unchanged. Sets
use the direct (blocking) path: the engine, with its fusion and
negotiation, serves the world communicator only. Sets that overlap are fine
as long as every member calls their collectives in the same order.

Adding a set costs one allgather of the rank lists over the world (so a
different list on one rank raises ``MismatchError`` on every rank) and one
communicator creation among the members.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from . import api
from .algorithms.allgather import allgather as _allgather_blocks
from .comm import Communicator
from .errors import InvalidArgumentError, MismatchError

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "process_set_by_id", "process_sets"]


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Args:
        ranks: the world ranks in the set (any order; kept sorted). Register it with
            :func:`add_process_set` before use.
    """

    def __init__(self, ranks: Iterable[int]):
        ranks = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in ranks):
            raise InvalidArgumentError(f"ProcessSet takes a list of integer ranks, got {ranks!r}")
        self.ranks: list[int] | None = sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None
        self._communicator: Communicator | None = None
        self._world: Communicator | None = None    # the world it was registered in (stale after shutdown)

    def _live(self) -> bool:
        if self.process_set_id == 0:
            return api.is_initialized()
        return self.process_set_id is not None and api.is_initialized() and self._world is api.communicator()

    def size(self) -> int | None:
        """The number of ranks in the set; ``None`` while it is not registered."""
        if not self._live():
            return None
        return api.size() if self.process_set_id == 0 else len(self.ranks)

    def included(self) -> bool | None:
        """Whether this rank is in the set; ``None`` while it is not registered."""
        if not self._live():
            return None
        return self.process_set_id == 0 or api.rank() in self.ranks

    def rank(self) -> int:
        """This rank's index within the set (0 .. size()-1); ``ValueError`` outside it."""
        return self.communicator.rank

    @property
    def communicator(self) -> Communicator:
        """The set's communicator. Raises ``InvalidArgumentError`` (a ``ValueError``) on a rank
        outside the set, or for a set that is not registered (any more)."""
        if self.process_set_id == 0:
            return api.communicator()
        if not self._live():
            raise InvalidArgumentError(f"{self} is not registered: call add_process_set() on every rank "
                                       "first (sets are dropped by remove_process_set() and shutdown())")
        if self._communicator is None:
            raise InvalidArgumentError(f"rank {api.rank()} is not in {self}: only its members may call its "
                                       "collectives (check ps.included() first)")
        return self._communicator

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registry: dict[int, ProcessSet] = {}
_registry_world: list = [None]       # the world communicator the registry belongs to


def _sets() -> dict[int, ProcessSet]:
    """The registered sets of this ``init()``; a new ``init()`` starts with none."""
    world = api.communicator()
    if _registry_world[0] is not world:
        _registry.clear()
        _registry_world[0] = world
    return _registry


def _agree_on_ranks(world: Communicator, ranks: list[int]) -> None:
    """Raise on every rank if the list is invalid on any rank, or differs between ranks."""
    p = world.size
    bad = len(ranks) > p or len(set(ranks)) != len(ranks) or not all(0 <= r < p for r in ranks)
    mine = np.full(p + 2, -1, np.int64)
    mine[0], mine[1] = int(bad), len(ranks)
    if not bad:
        mine[2:2 + len(ranks)] = ranks
    table = np.empty(p * mine.size, np.int64)
    _allgather_blocks(world.transport, mine, table)
    table = table.reshape(p, mine.size)
    for r in range(p):
        if table[r, 0]:
            raise InvalidArgumentError(f"add_process_set on rank {r}: the ranks must be distinct integers in "
                                       f"[0, {p}); rank {r} passed {int(table[r, 1])} that are not")
    if (table != table[0]).any():
        lists = "; ".join(f"rank {r}: {row[2:2 + int(row[1])].tolist()}" for r, row in enumerate(table))
        raise MismatchError(f"add_process_set: the ranks differ across ranks ({lists}). Every rank must add "
                            "the same sets in the same order.")


def _sub_communicator(world: Communicator, ranks: list[int]) -> Communicator | None:
    """A Communicator over ``ranks`` (collective over the members); ``None`` on other ranks."""
    if world.rank not in ranks:
        return None
    mpi_comm = getattr(world.transport, "comm", None)
    from .transport.mpi import MPITransport
    group = mpi_comm.Get_group().Incl(ranks)
    sub = mpi_comm.Create_group(group)
    group.Free()
    try:
        transport = MPITransport(sub, timeout=world.config.timeout)   # its own duplicate of sub
    finally:
        sub.Free()
    transport.fake_node_size = 0
    config = dataclasses.replace(world.config, fake_node_size=0)
    local_rank, local_size, _ = api._node_layout(transport.comm, 0)
    return Communicator(transport, config=config, local_rank=local_rank, local_size=local_size)


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a set of ranks (collective: every rank calls it, with the same ranks, in the same order).

    Args:
        process_set: a :class:`ProcessSet` or a list of world ranks.

    Returns:
        The registered :class:`ProcessSet` (the one given, now with an id).

    Raises ``InvalidArgumentError`` on every rank for a bad list on any rank, ``MismatchError``
    when ranks pass different lists, and ``ValueError`` for a set already registered.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = api.communicator()
    if getattr(world.transport, "comm", None) is None:
        raise InvalidArgumentError("process sets need the MPI transport (ar.init()); thread ranks have none")
    sets = _sets()
    global_process_set.ranks = list(range(world.size))
    if process_set.process_set_id is not None and process_set._live():
        raise InvalidArgumentError(f"{process_set} is already registered")
    _agree_on_ranks(world, process_set.ranks)
    if any(s.ranks == process_set.ranks for s in sets.values()):
        raise InvalidArgumentError(f"a process set with ranks {process_set.ranks} is already registered; "
                                   "use that one")
    process_set.process_set_id = max(sets, default=0) + 1
    process_set._world = world
    process_set._communicator = _sub_communicator(world, process_set.ranks)
    sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and free its communicator (collective over every rank).

    Returns:
        ``True`` if it was removed; ``False`` for the global set or a set not registered.
    """
    sets = _sets()
    world = api.communicator()
    set_id = process_set.process_set_id
    world.check_agreement("remove_process_set", count=-2 if set_id is None else set_id)
    if set_id is None or set_id == 0 or sets.get(set_id) is not process_set:
        return False
    del sets[set_id]
    if process_set._communicator is not None:
        process_set._communicator.close()
    process_set._communicator = process_set._world = None
    process_set.process_set_id = None
    return True


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The registered set with this id (0: the global set)."""
    if process_set_id == 0:
        return global_process_set
    try:
        return _sets()[process_set_id]
    except KeyError:
        raise InvalidArgumentError(f"no process set with id {process_set_id} is registered") from None


def process_sets() -> list[ProcessSet]:
    """Every registered set, the global one first."""
    return [global_process_set] + [s for _, s in sorted(_sets().items())]
