"""``fully_shard(model)``: ZeRO stage 3 for Keras 3. Each rank keeps 1/p of every weight; a layer's
whole weights exist only while it runs forward, and again while it runs backward.

What it does to a built model (PyTorch FSDP2's ``fully_shard`` on a module, in Keras terms)::

    model.layers          dense_0        dense_1  ...       each layer with trainable weights
                             │              │                is a *unit*
    before   kernel (whole), bias (whole)   ...
    after    kernel_shard (my piece, flat)  ...   layer.trainable_variables = the pieces;
             kernel: released (its tf.Variable dropped, memory freed)
             layer.call: gather, compute, release (.unit_call); save/load: whole weights

Steps: (1) refuse a model already wrapped, and check every rank holds the same model (names,
shapes, dtypes; ``MismatchError`` on every rank); (2) cut every weight over the ranks
(:mod:`.params`); (3) for each weight make a variable of this rank's piece and put it where the
layer kept the weight (so ``model.trainable_variables``, ``model.fit``'s tape and any optimizer
see the pieces), and drop the whole weight's storage; (4) wrap each unit's ``call``
(:func:`.unit_call.sharded_call`) and its ``save_own_variables`` / ``load_own_variables`` (a
checkpoint holds whole weights, as a plain model writes them; saving is a collective).

Under ``tfops.elastic`` a commit keeps the weights whole and a reset re-cuts every unit for the
new world (:mod:`.elastic_stage3`); a replacement wraps its model without meeting its peers
(they are not running ``fully_shard``): the sync that follows checks and fills it.

Memory per rank, float32 Adam, N parameters, p ranks, the largest unit holding U parameters:
4N/p weights + 4N/p gradients + 8N/p slots = 16N/p, plus about 3 x 4U while a unit is gathered
(its weights, the prefetched next unit's, and the gather's receive block, which is kept between
calls and so is held between steps too). Communication: 1.5x
the bytes of one allreduce of the gradients (:mod:`.unit_exchange`).
"""
from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

import allreduce as ar
from allreduce.algorithms.allgather import allgatherv
from allreduce.elastic import world

from .exchange import check_process_set, check_same_model, communicator_of
from .params import Status, UnitLayout
from .unit_call import sharded_call
from .unit_exchange import UnitExchange

__all__ = ["fully_shard", "FullyShardState", "Unit", "state_of", "gathered_weights"]


class Unit:
    """One wrapped layer: its whole weights (released), this rank's pieces, its state, the layout."""

    def __init__(self, index: int, layer, full_vars: list, shard_vars: list, nt_vars: list, layout: UnitLayout):
        self.index, self.layer, self.name = index, layer, layer.name
        self.full_vars, self.shard_vars, self.nt_vars, self.layout = full_vars, shard_vars, nt_vars, layout


class FullyShardState:
    """What ``fully_shard`` keeps beside the model (``state_of(model)``): the units, the
    communicator, the collectives (``exchange``: status, timeline). ``generation`` counts the
    cuts (an elastic reset makes a new one: :mod:`.elastic_stage3`); ``pending`` is a restored
    elastic commit waiting for the next sync. ``order``: the unit indices in the order the forward
    calls them, once one forward has called every unit (None before: model order is assumed)."""

    def __init__(self, units: list[Unit], comm, exchange: UnitExchange, *, name: str, process_set=None):
        self.units, self.comm, self.exchange, self.name, self.process_set = units, comm, exchange, name, process_set
        self.world = ar.communicator()                   # the world these pieces were cut in
        self.generation, self.pending = 0, None
        self.order, self._calls = None, []
        self.index_pieces()

    def called(self, unit: Unit) -> None:
        """Note that ``unit``'s forward was called (traced or eager). A subclassed model calls its
        layers in its own order, not ``model.layers``' (examples/gpt.py: the head is the second
        layer made and the last called), and the prefetch must follow the calls."""
        if unit.index in self._calls:                    # a new forward (or a unit called twice)
            self._calls = []
        self._calls.append(unit.index)
        if len(self._calls) == len(self.units):
            self.order = tuple(self._calls)

    def index_pieces(self) -> None:
        """Map every piece variable to its (unit, weight index): again after a re-cut."""
        self._piece_of = {id(s): (u, i) for u in self.units for i, s in enumerate(u.shard_vars)}

    def check_current(self) -> None:
        """Raise ``RuntimeError`` (naming the rank) if the world changed since these pieces were cut
        (an elastic shrink or regrow) and they were not re-cut for it (:mod:`.elastic_stage3`)."""
        now = ar.communicator()
        if now is self.world:
            return
        was = f"cut for {self.comm.size} ranks (rank {self.comm.rank})"
        if self.pending is not None:
            raise RuntimeError(f"rank {now.rank}: fully sharded model '{self.name}' is still {was} and the world is "
                               f"now {now.size} ranks: the elastic state's sync re-cuts it before the next step "
                               "(tfops.elastic.run calls it); to do it sooner call "
                               "tfops.sharding.elastic_stage3.reshard_if_needed(model, optimizer)")
        raise RuntimeError(f"rank {now.rank}: the world changed (now {now.size} ranks) but fully sharded model "
                           f"'{self.name}' ({was}) has no committed state to re-cut from: keep it and its "
                           "ShardedOptimizer(stage=3) in tfops.elastic.TensorFlowKerasState and train inside "
                           "tfops.elastic.run")

    def after(self, unit: Unit, phase: str) -> Unit | None:
        """The unit that runs next in ``phase``: call order forward, reverse backward (model order
        until a forward has called every unit)."""
        order = self.order or range(len(self.units))
        k = order.index(unit.index) + (1 if phase == "forward" else -1)
        return self.units[order[k]] if 0 <= k < len(order) else None

    def status(self, unit: int | str) -> Status:
        """The status of unit ``unit`` (index or layer name)."""
        u = unit if isinstance(unit, int) else next(x.index for x in self.units if x.name == unit)
        return self.exchange.status.get(u, Status.NOT_AVAILABLE)

    def piece_of(self, variable):
        """(unit, weight index) of a piece variable, or None."""
        return self._piece_of.get(id(variable))

    def whole(self, variable) -> np.ndarray:
        """The whole value of a piece variable (a collective: every rank calls it, in the same order)."""
        unit, i = self._piece_of[id(variable)]
        return self.gather_like(variable, np.asarray(variable.numpy()))

    def gather_like(self, variable, mine: np.ndarray) -> np.ndarray:
        """Every rank's ``mine`` (each cut as ``variable``'s piece) laid out whole (a collective)."""
        unit, i = self._piece_of[id(variable)]
        piece = unit.layout.piece(i)
        out = np.empty(sum(piece.counts), mine.dtype)
        if self.comm.size == 1:
            out[:] = mine.reshape(-1)
        else:
            allgatherv(self.comm.transport, np.ascontiguousarray(mine.reshape(-1)), out, list(piece.counts))
        return out.reshape(piece.shape)

    def mine(self, variable, whole) -> np.ndarray:
        """This rank's piece of ``whole`` (a value shaped as ``variable``'s whole weight)."""
        unit, i = self._piece_of[id(variable)]
        piece = unit.layout.piece(i)
        whole = np.asarray(whole)
        if tuple(whole.shape) != piece.shape:
            raise ValueError(f"fully_shard: {unit.full_vars[i].path} is {piece.shape} whole; got a value of shape "
                             f"{tuple(whole.shape)}")
        r = self.comm.rank
        return whole.reshape(-1)[piece.starts[r]:piece.starts[r] + piece.counts[r]]


def state_of(model) -> FullyShardState | None:
    """The :class:`FullyShardState` of a model ``fully_shard`` wrapped, else None."""
    return getattr(model, "_tfops_fully_shard", None)


def _released(path: str):
    def initializer(*_args, **_kwargs):
        raise RuntimeError(f"{path} is fully sharded (tfops.fully_shard): this rank holds only its piece. Call the "
                           "layer (it gathers the weight), or use tfops.sharding.gathered_weights(model)")
    return initializer


def _units_of(model) -> list:
    layers = [l for l in model.layers if l.trainable_variables]
    if any(getattr(l, "_tfops_fully_shard_unit", None) is not None for l in layers):
        raise ValueError(f"fully_shard: model '{model.name}' has layers that are already fully sharded "
                         "(fully_shard wraps a model once)")
    covered = {id(v) for l in layers for v in l.trainable_variables}
    left = [v.path for v in model.trainable_variables if id(v) not in covered]
    if left:
        raise ValueError(f"fully_shard: model '{model.name}' has trainable weights outside its layers ({left[:3]}); "
                         "put them in a layer, so that a layer gathers them")
    return layers


def _make_piece(full, mine: np.ndarray):
    """A variable of this rank's piece, at the whole weight's path + ``_shard``."""
    with contextlib.ExitStack() as scopes:
        for part in full.path.split("/")[:-1]:
            scopes.enter_context(keras.name_scope(part))
        return keras.Variable(mine, dtype=full.dtype, trainable=True, name=f"{full.name}_shard")


def _swap(model, swaps: dict) -> list:
    """Put each piece where a layer (at any depth) kept its whole weight; the layers touched."""
    owners = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        own = layer._trainable_variables
        hit = [k for k, v in enumerate(own) if id(v) in swaps]
        for k in hit:
            own[k] = swaps[id(own[k])]
        if hit:
            owners.append(layer)
    return owners


def _patch_saving(state: FullyShardState, layer) -> None:
    """Checkpoints of ``layer`` hold whole weights (a plain model's file); loading cuts this rank's piece."""
    def variables():
        return layer._trainable_variables + layer._non_trainable_variables

    def save_own_variables(store):
        for i, v in enumerate(variables()):
            store[f"{i}"] = state.whole(v) if state.piece_of(v) else v.numpy()

    def load_own_variables(store):
        vs = variables()
        if len(store.keys()) != len(vs):
            raise ValueError(f"fully_shard: layer '{layer.name}' has {len(vs)} variables, the file holds "
                             f"{len(store.keys())} for it")
        for i, v in enumerate(vs):
            value = store[f"{i}"]
            v.assign(state.mine(v, value) if state.piece_of(v) else value)
    object.__setattr__(layer, "save_own_variables", save_own_variables)
    object.__setattr__(layer, "load_own_variables", load_own_variables)


def layout_of(fulls: list, size: int, turn: int) -> tuple[UnitLayout, int]:
    """The layout of a unit whose whole weights are ``fulls`` over ``size`` ranks, and the next
    unit's ``turn`` (units are cut in model order from turn 0: a re-cut must match a new wrap)."""
    return UnitLayout.of([tuple(v.shape) for v in fulls], [tf.as_dtype(v.dtype).name for v in fulls], size, turn)


def _cut(layer, index: int, comm, turn: int, sync_weights: bool, swaps: dict):
    """The :class:`Unit` of ``layer``: its weights' layout and this rank's pieces (``swaps``: whole
    weight id -> piece); and the next unit's ``turn``."""
    fulls = list(layer.trainable_variables)
    layout, turn = layout_of(fulls, comm.size, turn)
    pieces = []
    for i, full in enumerate(fulls):
        p = layout.piece(i)
        s = p.starts[comm.rank]
        whole = np.ascontiguousarray(full.numpy()).reshape(-1)
        if sync_weights and comm.size > 1:
            whole = np.asarray(comm.broadcast(whole, 0)).reshape(-1)
        pieces.append(_make_piece(full, whole[s:s + p.counts[comm.rank]].copy()))
        swaps[id(full)] = pieces[-1]
    return Unit(index, layer, fulls, pieces, list(layer.non_trainable_variables), layout), turn


def _release(unit: Unit) -> None:
    for full in unit.full_vars:
        if full._value is not None:                           # the whole weight's memory goes
            full._value, full._initializer = None, _released(full.path)


def fully_shard(model, *, process_set=None, prefetch: bool = True, sync_weights: bool = True, input_shape=None):
    """Shard every trainable weight of the built Keras 3 ``model`` over the ranks (ZeRO stage 3).

    Each layer of ``model.layers`` that has trainable weights becomes a unit: it gathers its
    weights just before it runs, forward and backward, and its weights' gradients come out of
    the tape already averaged over the ranks, as this rank's pieces. Train it with
    ``tfops.ShardedOptimizer(optimizer, stage=3)`` (``model.fit``, or a custom loop with a plain
    ``tf.GradientTape``, eager or in a ``tf.function``).

    Args:
        model: a built ``keras.Model`` (Sequential, functional or subclassed) whose trainable
            weights all belong to its layers; the same on every rank.
        process_set: shard over these ranks only (e.g. ``mesh.data_set``); default every rank.
        prefetch: hand the next unit's gather over while the current unit computes.
        sync_weights: cut every rank's pieces out of the first rank's whole weights (one broadcast
            of the model, as FSDP's ``sync_module_states``), so ranks that initialised apart agree.
            Broadcast nothing afterwards (``BroadcastGlobalVariablesCallback`` would overwrite
            each rank's pieces with the first rank's).
        input_shape: for a ``keras.Sequential`` not built yet (no ``keras.Input``): its input
            shape with the batch (``(None, 2048)``). Each layer is built and cut in turn, so the
            whole model never exists on one rank (DeepSpeed's ``zero.Init``); then the model is
            built.

    Returns:
        ``model``, changed in place: ``model.trainable_variables`` are this rank's pieces (flat);
        ``model.save`` / ``save_weights`` write whole weights (every rank calls them) and
        ``load_weights`` reads a plain model's file at any rank count.
    """
    if state_of(model) is not None:
        raise ValueError(f"fully_shard: model '{model.name}' is already fully sharded; wrap it once")
    lazy = not model.built
    if lazy and (input_shape is None or not isinstance(model, keras.Sequential)):
        raise ValueError(f"fully_shard: build model '{model.name}' first (call it on a batch, or model.build), or "
                         "pass input_shape= for a Sequential (each layer is then built and cut in turn)")
    comm = communicator_of(check_process_set(process_set))
    layers = list(model.layers) if lazy else _units_of(model)
    alone = world.joining()          # a replacement: its peers run no fully_shard; the sync checks and fills it
    if not lazy and not alone:
        check_same_model(model.trainable_variables, "fully_shard", comm=comm)
    units, swaps, turn, shape = [], {}, 0, tuple(input_shape) if lazy else None
    for layer in layers:
        if lazy:                                              # the whole model never exists at once
            if getattr(layer, "_tfops_fully_shard_unit", None) is not None:
                raise ValueError(f"fully_shard: layer '{layer.name}' is already fully sharded")
            if not layer.built:
                layer.build(shape)
            shape = layer.compute_output_shape(shape)
            if not layer.trainable_variables:
                continue
            if not alone:
                check_same_model(layer.trainable_variables, f"fully_shard (layer '{layer.name}')", comm=comm)
        unit, turn = _cut(layer, len(units), comm, turn, sync_weights and not alone, swaps)
        units.append(unit)
        if lazy:
            _release(unit)
    state = FullyShardState(units, comm, UnitExchange(comm, prefetch=prefetch), name=model.name,
                            process_set=process_set)
    for piece in swaps.values():
        object.__setattr__(piece, "_tfops_fully_shard", state)    # for ShardedOptimizer(stage=3)
    for layer in _swap(model, swaps):
        _patch_saving(state, layer)
    for unit in units:
        _release(unit)
        object.__setattr__(unit.layer, "_tfops_fully_shard_unit", unit)
        object.__setattr__(unit.layer, "call", sharded_call(state, unit, unit.layer.call))
    object.__setattr__(model, "_tfops_fully_shard", state)
    if lazy:
        model.build(tuple(input_shape))
    for fn in ("train_function", "test_function", "predict_function"):
        if getattr(model, fn, None) is not None:                  # traced over the whole weights
            setattr(model, fn, None)
    return model


def gathered_weights(model) -> list[np.ndarray]:
    """``model.get_weights()`` as a plain model's: whole weights (a collective: every rank calls)."""
    state = state_of(model)
    if state is None:
        return model.get_weights()
    return [state.whole(v) if state.piece_of(v) else v.numpy() for v in model.weights]
