"""``hvd.elastic.run`` for TensorFlow: a peer's death recognised through TensorFlow's errors.

An error of the library raised inside a TensorFlow op reaches Python as a
``tf.errors.OpError`` that carries only its text; :func:`run` recognises a
peer's death there by the text as well (``PeerLostError``, ``MPI_ERR_PROC_FAILED``,
``MPI_ERR_REVOKED``). After the world is rebuilt (a shrink or a regrow), every rank that
was already running redoes what :func:`tfops.init` does after ``ar.init()``
(:func:`_after_rebuild`, registered with :mod:`allreduce.elastic.world`).
"""
from __future__ import annotations

from typing import Callable

from allreduce import api as _api
from allreduce.elastic import world as _world

__all__ = ["run", "is_peer_failure"]

_WORDS = ("PeerLostError", "MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED")


def is_peer_failure(exc: BaseException) -> bool:
    """A peer's death, raised directly or wrapped by TensorFlow (by its text) or chained."""
    from allreduce.transport.liveness import is_peer_failure as direct
    seen = 0
    while exc is not None and seen < 8:
        if direct(exc) or any(word in str(exc) for word in _WORDS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _after_rebuild() -> None:
    """What :func:`tfops.init` does after ``ar.init()``, redone on every rank of a shrunk or grown
    world: a replacement runs ``tfops.init`` itself, the others this (allreduce/elastic/world.py)."""
    import tfops
    from ..collectives import queries
    queries._layout.clear()     # keyed by id(communicator): the new one may reuse the old one's id
    queries.is_homogeneous()    # the layout allgather, as tfops.init runs it
    tfops.global_process_set.ranks = list(range(_api.size()))


_world.rebuild_hooks.append(_after_rebuild)


def run(func: Callable) -> Callable:
    """:func:`allreduce.elastic.run` that also sees a death through TensorFlow's errors."""
    from allreduce.elastic.recovery import run_with
    return run_with(func, is_failure=is_peer_failure)
