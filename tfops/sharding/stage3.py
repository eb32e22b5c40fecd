"""``ShardedOptimizer(optimizer, stage=3)``: the optimizer of a ``fully_shard`` model.

Stage 3's gradients come out of the tape already reduce-scattered (:mod:`.unit_call`): each is
this rank's piece of the averaged gradient, shaped as its piece variable. So the step is the
inner optimizer's own ``apply`` over the pieces, and it talks to no other rank (only true-norm
clipping does, one small allreduce, :mod:`.norms`)::

    tape.gradient  ──>  my pieces of the averaged gradients ──> clip by the true norms (if asked)
                                                            ──> inner.apply(pieces, piece variables)
    the weights stay in pieces; the next forward gathers them layer by layer

Every slot the inner optimizer makes is shaped as a piece: N/p elements per slot. Checkpoints
hold the whole state, as a plain optimizer over the plain model writes it (each slot gathered,
in the inner optimizer's own order, :func:`.state._slot_order`), so they load at any rank count
and into a plain optimizer; a plain optimizer's file loads here. Saving is a collective.
After an elastic re-cut (:mod:`.elastic_stage3`) :meth:`FullyShardedOptimizer.rebuild` makes a
fresh inner optimizer over the new pieces; the commit's whole state is then cut into it.
"""
from __future__ import annotations

import keras
import numpy as np

from ..training.wrapping import WrappingOptimizer
from .checks import check_inner, from_tape
from .norms import clip_segments
from .state import _slot_order

__all__ = ["FullyShardedOptimizer"]


def _not_saved(store) -> None:
    """The inner optimizer's own save/load: the wrapper writes the state, gathered."""


def _owner(variables) -> object:
    """The :class:`.fully_shard.FullyShardState` the piece variables belong to (all to one)."""
    found = {}
    for v in variables:
        state = getattr(v, "_tfops_fully_shard", None)
        if state is None:
            raise ValueError(f"ShardedOptimizer(stage=3) steps the pieces of a model wrapped by tfops.fully_shard; "
                             f"'{v.path}' is not one. Call tfops.fully_shard(model) before building the optimizer")
        found[id(state)] = state
    if len(found) != 1:
        raise ValueError("ShardedOptimizer(stage=3): the variables belong to several fully sharded models; use one "
                         "optimizer per model")
    return next(iter(found.values()))


@keras.saving.register_keras_serializable(package="tfops", name="FullyShardedOptimizer")
class FullyShardedOptimizer(WrappingOptimizer):
    """What ``ShardedOptimizer(optimizer, stage=3)`` returns; ``inner_optimizer`` steps the pieces."""

    def __init__(self, inner_optimizer, *, name=None, clipnorm_of_model=None, global_clipnorm_of_model=None,
                 **_ignored):
        check_inner(inner_optimizer)
        super().__init__(learning_rate=0.0, name=name or f"Sharded{inner_optimizer.name}")
        self.stage = 3
        self.shard_clipnorm = clipnorm_of_model if clipnorm_of_model is not None else inner_optimizer.clipnorm
        self.shard_global_clipnorm = (global_clipnorm_of_model if global_clipnorm_of_model is not None
                                      else inner_optimizer.global_clipnorm)
        inner_optimizer.clipnorm = inner_optimizer.global_clipnorm = None   # a piece's norm is not the weight's
        inner_optimizer.save_own_variables = inner_optimizer.load_own_variables = _not_saved
        self.inner_optimizer = inner_optimizer

    def build(self, var_list):
        var_list = list(var_list)
        self._fs = _owner(var_list)
        self._pieces = var_list
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    def apply_gradients(self, grads_and_vars, **kwargs):
        grads, variables = zip(*list(grads_and_vars))
        self.apply(list(grads), list(variables))
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Step the inner optimizer on this rank's pieces with ``grads`` (already averaged)."""
        variables = list(trainable_variables) if trainable_variables is not None else getattr(self, "_pieces", None)
        if variables is None:
            raise ValueError("build the optimizer first, or pass trainable_variables")
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        else:
            self._fs.check_current()                      # after an elastic reset: re-cut first
        grads = list(grads)
        if len(variables) != len(self._pieces) or any(v is not w for v, w in zip(variables, self._pieces)):
            raise ValueError(f"ShardedOptimizer(stage=3) was built for {len(self._pieces)} variables and is applied "
                             f"to {len(variables)} others; apply it to model.trainable_variables every step")
        missing = [v.path for g, v in zip(grads, variables) if g is None]
        if missing:
            raise ValueError(f"ShardedOptimizer(stage=3) needs a gradient for every piece; none for {missing[:5]}")
        if any(from_tape(g) for g in grads):
            raise ValueError("ShardedOptimizer(stage=3) got gradients a DistributedGradientTape reduced; a fully "
                             "sharded model's gradients come out of a plain tf.GradientTape already averaged")
        grads = clip_segments(grads, list(range(len(grads))), len(grads), clipnorm=self.shard_clipnorm,
                              global_clipnorm=self.shard_global_clipnorm, comm=self._fs.comm)
        self.inner_optimizer.apply(grads, variables)

    def rebuild(self, pieces) -> None:
        """A fresh inner optimizer built over ``pieces``, the model's pieces after an elastic re-cut
        (a variable's shape is fixed, so the old slots cannot take the new cut); its state is
        loaded next (``load_own_variables``). AdamW's variables excluded from weight decay stay
        excluded: Keras keys them by ``id``, so the old pieces' keys are mapped onto the new."""
        old, pieces = self.inner_optimizer, list(pieces)
        fresh = type(old).from_config(old.get_config())
        fresh.save_own_variables = fresh.load_own_variables = _not_saved
        excluded = getattr(old, "_exclude_from_weight_decay", None) or set()
        fresh._exclude_from_weight_decay = {fresh._var_key(new) for was, new in zip(self._pieces, pieces)
                                            if old._var_key(was) in excluded}
        fresh._exclude_from_weight_decay_pattern = getattr(old, "_exclude_from_weight_decay_pattern", None)
        fresh._exclude_from_weight_decay_cache = {}
        self.inner_optimizer, self._pieces = fresh, pieces
        with keras.name_scope(self.name, caller=self):
            fresh.build(pieces)
        self._trainable_variables = pieces[:]             # Keras' own bookkeeping of what it steps
        self._trainable_variables_indices = {self._var_key(v): i for i, v in enumerate(pieces)}

    # -- checkpoints: the plain optimizer's layout, slots whole ----------------------------
    def _layout(self):
        own, slots, interleaved = _slot_order(self.inner_optimizer)
        n = len(self._pieces)
        order = [(i, s) for i in range(n) for s in slots] if interleaved else [(i, s) for s in slots for i in range(n)]
        names = {}
        for v in self.inner_optimizer.variables[own:]:
            k = max((k for k, p in enumerate(self._pieces) if v.name.startswith(p.path.replace("/", "_") + "_")),
                    key=lambda k: len(self._pieces[k].path))
            names[(k, v.name[len(self._pieces[k].path.replace("/", "_")) + 1:])] = v
        return self.inner_optimizer.variables[:own], order, names

    def save_own_variables(self, store):
        """The whole state, as a plain optimizer writes it (every rank calls it: slots are gathered)."""
        own, order, slots = self._layout()
        for i, v in enumerate(own):
            store[str(i)] = v.numpy()
        for k, (i, s) in enumerate(order):
            store[str(len(own) + k)] = self._fs.gather_like(self._pieces[i], np.asarray(slots[(i, s)].numpy()))

    def load_own_variables(self, store):
        """A plain layout (any rank count, or a plain optimizer's file) into this rank's pieces."""
        if not self.built:
            raise ValueError("ShardedOptimizer(stage=3): build it (optimizer.build(model.trainable_variables)) "
                             "before loading")
        own, order, slots = self._layout()
        if len(store.keys()) != len(own) + len(order):
            raise ValueError(f"ShardedOptimizer(stage=3): the file holds {len(store.keys())} optimizer variables, a "
                             f"{type(self.inner_optimizer).__name__} over this model has {len(own) + len(order)}")
        for i, v in enumerate(own):
            v.assign(store[str(i)])
        for k, (i, s) in enumerate(order):
            slots[(i, s)].assign(self._fs.mine(self._pieces[i], store[str(len(own) + k)]))

    # -- what belongs to the inner optimizer ---------------------------------------------
    @property
    def variables(self):
        """The scalars every rank holds alike (iteration, learning rate); the slots are pieces."""
        return [v for v in self.inner_optimizer.variables if len(v.shape) == 0]

    def finalize_variable_values(self, var_list):
        pass

    def get_config(self):
        return {"name": self.name, "stage": 3, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "clipnorm_of_model": self.shard_clipnorm, "global_clipnorm_of_model": self.shard_global_clipnorm}
