"""A sharded optimizer under ``tfops.elastic``: commit the whole state, re-shard after a reset.

A rank that dies takes its shard of the optimizer state with it, so a commit cannot keep only
this rank's shard. :func:`save` gathers the state whole (the plain layout of :mod:`.state`:
one allgather per slot and variable) into host memory on every rank, as the model's weights
already are; :func:`restore` only remembers it (``restore`` runs on the survivors alone, before
the world is rebuilt); the next step, every rank of the new world together, lays the shards out
for the new (rank, size), builds a fresh inner optimizer over them and cuts its segments out of
the remembered state (:func:`reshard_if_needed`)::

    commit (p = 3)     every rank: gathered state S_k, model weights W_k
    rank 2 dies        survivors: restore -> W_k, S_k remembered
    world p = 2        first step: layout for p = 2, inner optimizer rebuilt, segments of S_k
    regrow p = 3       sync: rank 0's (W_k', S_k') broadcast; every rank re-shards the same way

Cost per commit: the state gathered, (p-1)/p of K bytes per parameter received, and K bytes
per parameter of host memory held until the next commit (K = 8 for Adam). A ``tf.function`` that
applied the optimizer before the reset holds the old layout: make a new one after a reset
(``state.register_reset_callbacks``); eager loops need nothing, and for ``model.fit``
``TensorFlowKerasState``'s restore drops the model's traced train function, so the next ``fit``
traces one for the new layout.
"""
from __future__ import annotations

import numpy as np

import allreduce as ar

__all__ = ["save", "restore", "reshard_if_needed"]


def save(wrapper) -> list[np.ndarray]:
    """The whole optimizer state (every rank calls it: a collective); ``[]`` if not built yet."""
    if not wrapper.built:
        return []
    reshard_if_needed(wrapper)
    state = wrapper._gathered()
    store: dict = {}
    state.save_to(store)
    return [np.array(store[str(i)], copy=True) for i in range(len(store))]


def restore(wrapper, values: list[np.ndarray]) -> None:
    """Remember ``values`` (from :func:`save`, on this or another world); loaded at the next step."""
    wrapper._pending_state = list(values) if values else None


def reshard_if_needed(wrapper) -> None:
    """Lay the shards out again if the world changed, and load a remembered state (collective:
    every rank of the new world at its next step). Nothing to do before the first build: the
    build lays out for the current world and then loads what a sync delivered."""
    if not wrapper.built:
        return
    pending = getattr(wrapper, "_pending_state", None)
    if wrapper._laid_out_for != (ar.rank(), ar.size()):
        if pending is None:
            raise RuntimeError("ShardedOptimizer: the world changed but no committed state was restored; keep "
                               "the optimizer in tfops.elastic.TensorFlowKerasState and step inside elastic.run")
        old = wrapper.inner_optimizer
        fresh = type(old).from_config(old.get_config())
        fresh.save_own_variables = fresh.load_own_variables = old.load_own_variables
        fresh._exclude_from_weight_decay_pattern = getattr(old, "_exclude_from_weight_decay_pattern", None)
        wrapper.inner_optimizer = fresh
        wrapper._lay_out()
    if pending is not None:
        wrapper._pending_state = None
        wrapper._gathered().load_from({str(i): v for i, v in enumerate(pending)})
