"""The process-wide default communicator behind ``ar.init()`` and friends.

``import allreduce as ar; ar.init()`` builds one :class:`Communicator` over
MPI (``COMM_WORLD`` or the ``comm`` given) and every module-level function
forwards to it. Calling a collective before ``init()`` or after
``shutdown()`` raises :class:`~allreduce.errors.NotInitializedError`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .comm import Communicator
from .config import Config
from .errors import NotInitializedError
from .ops import Op

__all__ = ["init", "shutdown", "is_initialized", "communicator", "rank", "size", "local_rank",
           "local_size", "allreduce", "allreduce_", "broadcast", "allgather", "reducescatter",
           "broadcast_object", "allgather_object", "barrier"]

_current: Communicator | None = None


def _node_layout(mpi_comm, fake_node_size: int) -> tuple[int, int]:
    """``(local_rank, local_size)``: this rank's place among the ranks on its node."""
    from mpi4py import MPI
    if fake_node_size:
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        node = rank // fake_node_size
        return rank % fake_node_size, min(fake_node_size, size - node * fake_node_size)
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def init(comm=None, **settings: Any) -> Communicator:
    """Start the library on every rank of ``comm`` (an mpi4py communicator; default COMM_WORLD).

    Keyword arguments override :class:`~allreduce.config.Config` fields and
    the ``ALLREDUCE_*`` environment. Calling ``init()`` again is a no-op that
    returns the existing communicator.
    """
    global _current
    if _current is not None:
        return _current
    from .transport.mpi import MPITransport
    config = Config.from_env(**settings)
    transport = MPITransport(comm)
    local_rank, local_size = _node_layout(transport.comm, config.fake_node_size)
    _current = Communicator(transport, config=config, local_rank=local_rank, local_size=local_size)
    return _current


def shutdown() -> None:
    """Release the communicator. Collectives raise until ``init()`` is called again."""
    global _current
    if _current is not None:
        current, _current = _current, None
        current.close()


def is_initialized() -> bool:
    return _current is not None


def communicator() -> Communicator:
    """The communicator ``init()`` built; raises ``NotInitializedError`` before it."""
    if _current is None:
        raise NotInitializedError("allreduce is not initialized: call ar.init() first "
                                  "(or again, after ar.shutdown())")
    return _current


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    return communicator().local_rank


def local_size() -> int:
    return communicator().local_size


def allreduce(x, op=Op.AVERAGE, algorithm: str | None = None, name: str | None = None) -> np.ndarray:
    """Return ``x`` reduced with ``op`` over all ranks, as a new array of the same shape and dtype.

    Args:
        x: a numpy array (any shape, contiguous or not) of a supported dtype.
        op: ``ar.Sum``, ``ar.Average`` (default), ``ar.Min``, ``ar.Max`` or ``ar.Product``.
        algorithm: ``"auto"`` (default from config), ``"ring"``, ``"tree"``, ``"rhd"``, ``"rd"`` or ``"mpi"``.
        name: a name for the tensor; reserved for the engine's negotiated path.

    Returns:
        The reduced array; bitwise identical on every rank.
    """
    return communicator().allreduce(x, op, algorithm=algorithm)


def allreduce_(x: np.ndarray, op=Op.AVERAGE, algorithm: str | None = None, name: str | None = None) -> np.ndarray:
    """In-place :func:`allreduce`: ``x`` (writeable numpy array) receives the result and is returned."""
    return communicator().allreduce_(x, op, algorithm=algorithm)


def broadcast(x, root_rank: int = 0) -> np.ndarray:
    """Root's ``x`` on every rank (a new array)."""
    return communicator().broadcast(x, root_rank)


def allgather(x) -> np.ndarray:
    """Every rank's ``x`` concatenated along axis 0, in rank order."""
    return communicator().allgather(x)


def reducescatter(x, op=Op.AVERAGE) -> np.ndarray:
    """Reduce ``x`` and keep this rank's slice of axis 0."""
    return communicator().reducescatter(x, op)


def broadcast_object(obj: Any = None, root_rank: int = 0) -> Any:
    """Root's picklable ``obj`` on every rank."""
    return communicator().broadcast_object(obj, root_rank)


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, as a list in rank order."""
    return communicator().allgather_object(obj)


def barrier() -> None:
    """Wait until every rank arrives."""
    communicator().barrier()
