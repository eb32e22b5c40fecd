"""ZeRO stage 3 under ``tfops.elastic``: commit the weights and the optimizer state whole, re-cut
every unit for the new world after a shrink or a regrow.

A rank that dies takes its pieces with it: 1/p of every weight and of every optimizer slot exist
only there. So a commit keeps nothing cut. :func:`save` gathers every weight whole
(:func:`.fully_shard.gathered_weights`) and the optimizer state whole (the plain layout of
:mod:`.stage3`) into host memory on every rank. :func:`restore` runs on the survivors alone,
before the new world exists, so it only remembers them (``pending``). :func:`sync` runs on every
rank of the new world before its first step: it checks that every rank holds the same model,
re-cuts every unit for the new (rank, size) where the cut is old, and cuts the commit into the
pieces. The re-cut sends nothing: every rank holds the whole commit::

    commit (p = 3)   every rank: weights W_k whole, optimizer state S_k whole (host memory)
    rank 2 dies      survivors: restore -> (W_k, S_k) pending; the pieces are left as they are
    world p = 2      sync (every rank): same model? (one allgather of a digest); each unit re-cut:
                     rank r's pieces of W_k as new variables where the layer keeps its pieces,
                     a new exchange on the new communicator; a fresh inner optimizer over the
                     new pieces, S_k cut into it
    regrow p = 3     the replacement wraps its model alone (allreduce.elastic.world.joining);
                     sync: rank 0's commit broadcast; the survivors re-cut for 3, the
                     replacement cuts it into the pieces it has

Steps of a re-cut, unit by unit in model order (the turn of the one-larger pieces carried from
unit to unit from 0, exactly as ``fully_shard`` cuts, so a replacement's fresh wrap and a
survivor's re-cut agree): (1) the unit's layout for the new size (:mod:`.params`); (2) each
weight's piece, ``W.flat[start_r : start_r + count_r]``, as a new variable at the old piece's
path (a ``tf.Variable``'s shape is fixed); (3) each old piece swapped for its new one in every
layer that listed it; (4) the model's state: layouts, pieces, communicator, a new
:class:`.unit_exchange.UnitExchange` (the old one's worker retired), ``generation`` + 1;
(5) the optimizer: :meth:`.stage3.FullyShardedOptimizer.rebuild` and ``load_own_variables``.

Cost, N parameters, p ranks, K bytes of slots per parameter (Adam, float32: K = 8): a commit
gathers each weight and each slot: (p-1)/p x (4 + K) N bytes received per rank, one allgather
per weight and per slot. It then holds (4 + K) N bytes (12 N with Adam) on *every* rank until the
next commit: the whole model and its whole state, not 1/p of it. That is host RAM, not device
memory (on a GPU the pieces stay on the device and the commit lives in the host's memory), and
it is what Horovod's elastic ``TensorFlowKerasState`` keeps on every worker for any model; a
model that fits stage 3 only because its whole state does not fit one host cannot be committed
this way. A sync broadcasts rank 0's commit ((4 + K) N bytes, pickled); a re-cut sends nothing and
makes (4 + K) N / p bytes of new pieces and slots while the old ones are let go.

Traced functions hold the old pieces. ``TensorFlowKerasState`` drops ``model.train_function`` at
every restore and sync, so ``model.fit`` (and ``train_on_batch``) trace anew; a custom
``tf.function`` must be made again in a reset callback (``state.register_reset_callbacks``), as
for stages 1 and 2 (:mod:`.elastic`). One traced before a re-cut raises ``RuntimeError`` at its
first gather instead of mixing layouts (:mod:`.unit_call`), and a step of a model the world
changed under without a restored commit raises one naming the rank
(:meth:`.fully_shard.FullyShardState.check_current`). Only models sharded over the world are
re-cut; ``fully_shard(process_set=...)`` under ``--elastic`` raises ``ValueError`` at the commit.
"""
from __future__ import annotations

import keras
import numpy as np

import allreduce as ar

from .exchange import check_same_model
from .fully_shard import _make_piece, _swap, gathered_weights, layout_of, state_of
from .stage3 import FullyShardedOptimizer
from .unit_exchange import UnitExchange

__all__ = ["save", "restore", "sync", "reshard_if_needed"]


def _state(model):
    """The model's :class:`.fully_shard.FullyShardState`, refusing what cannot be re-cut."""
    fs = state_of(model)
    if fs is None:
        raise ValueError(f"rank {ar.rank()}: model '{model.name}' is not fully sharded (tfops.fully_shard)")
    if fs.process_set is not None and fs.process_set.process_set_id != 0:
        raise ValueError(f"rank {ar.rank()}: model '{model.name}' is fully sharded over {fs.process_set}; an elastic "
                         "commit re-cuts models sharded over every rank only (fully_shard without process_set)")
    return fs


def _check_optimizer(model, optimizer) -> None:
    if optimizer is not None and not isinstance(optimizer, FullyShardedOptimizer):
        raise TypeError(f"rank {ar.rank()}: fully sharded model '{model.name}' is kept with a "
                        f"{type(optimizer).__name__}; its optimizer must be tfops.ShardedOptimizer(opt, stage=3), "
                        "whose state a commit can gather whole")


def save(model, optimizer) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The whole weights (as ``model.weights`` lists them) and the whole optimizer state (``[]``
    before it is built), in host memory. A collective: every rank calls it."""
    _state(model)
    _check_optimizer(model, optimizer)
    reshard_if_needed(model, optimizer)                 # a commit between a restore and the sync
    weights = [np.array(w, copy=True) for w in gathered_weights(model)]
    if optimizer is None or not optimizer.built:
        return weights, []
    store: dict = {}
    optimizer.save_own_variables(store)
    return weights, [np.array(store[str(i)], copy=True) for i in range(len(store))]


def restore(model, optimizer, weights: list, state: list) -> None:
    """Remember a commit (from :func:`save`, on this or another world); :func:`sync` or
    :func:`reshard_if_needed` cuts it into the pieces. Sends nothing: the survivors call it
    before the new world exists."""
    _check_optimizer(model, optimizer)
    _state(model).pending = (list(weights), list(state or []))


def sync(model, optimizer) -> None:
    """After the commit was broadcast and :func:`restore`\\ d: check that every rank of the (new)
    world holds the same model, then re-cut and load (collective: every rank of the world)."""
    fs = _state(model)
    check_same_model([v for u in fs.units for v in u.full_vars], f"fully_shard (elastic sync of '{fs.name}')",
                     comm=ar.communicator())
    reshard_if_needed(model, optimizer)


def reshard_if_needed(model, optimizer=None) -> None:
    """Re-cut the model (and ``optimizer``) for the world that runs now if it changed, and cut a
    remembered commit into the pieces. Sends nothing (the commit is whole on every rank), so it
    may run on any rank at any time after the new world exists. ``RuntimeError`` if the world
    changed and no commit was restored."""
    fs = _state(model)
    _check_optimizer(model, optimizer)
    stale = fs.world is not ar.communicator()
    if fs.pending is None:
        fs.check_current()                              # stale without a commit: the error says what to do
        return
    weights, state = fs.pending
    if len(weights) != len(model.weights):
        raise ValueError(f"rank {ar.rank()}: fully sharded model '{fs.name}' has {len(model.weights)} weights, the "
                         f"commit {len(weights)}: build the same model on every rank (a replacement too)")
    swaps = _recut(model, fs, weights) if stale else {}
    made = {id(new) for new in swaps.values()}          # new pieces were made holding the commit
    for k, v in enumerate(model.weights):               # the pieces of this cut, and every unsharded weight
        if id(v) not in made:
            v.assign(fs.mine(v, weights[k]) if fs.piece_of(v) else weights[k])
    if optimizer is not None:
        if optimizer.built and (stale or not state):    # new pieces, or back to an unbuilt optimizer
            optimizer.rebuild([swaps.get(id(p), p) for p in optimizer._pieces])
        if state:
            if not optimizer.built:                     # a replacement: built here, loaded below
                with keras.name_scope(optimizer.name, caller=optimizer):
                    optimizer.build(model.trainable_variables)
            optimizer.load_own_variables({str(i): v for i, v in enumerate(state)})
    fs.pending = None


def _recut(model, fs, weights: list) -> dict:
    """Steps (1)-(4) of the module doc; returns {id(old piece): new piece}."""
    comm = ar.communicator()
    at = {id(v): k for k, v in enumerate(model.weights)}
    swaps, turn = {}, 0
    for unit in fs.units:
        layout, turn = layout_of(unit.full_vars, comm.size, turn)
        pieces = []
        for i, (full, old) in enumerate(zip(unit.full_vars, unit.shard_vars)):
            piece, whole = layout.piece(i), np.asarray(weights[at[id(old)]])
            if tuple(whole.shape) != piece.shape:
                raise ValueError(f"rank {comm.rank}: {full.path} is {piece.shape} whole; the commit holds "
                                 f"{tuple(whole.shape)}")
            start = piece.starts[comm.rank]
            new = _make_piece(full, whole.reshape(-1)[start:start + piece.counts[comm.rank]].copy())
            object.__setattr__(new, "_tfops_fully_shard", fs)    # for ShardedOptimizer(stage=3)
            swaps[id(old)] = new
            pieces.append(new)
        unit.layout, unit.shard_vars = layout, pieces
    _swap(model, swaps)
    fs.exchange.close()
    fs.exchange = UnitExchange(comm, prefetch=fs.exchange.prefetch)
    fs.comm = fs.world = comm
    fs.generation += 1
    fs.index_pieces()
    return swaps
