"""What an elastic commit keeps for TensorFlow: ``TensorFlowState`` (variables) and
``TensorFlowKerasState`` (a Keras model's weights and its optimizer's variables).

A state holds, besides its keyword attributes (``epoch``, ``batch``, any
picklable value), the model's weights and the optimizer's variables (Keras 3:
``optimizer.variables``, the iteration count and every slot such as momentum).
``commit()`` copies them to host memory (one ``numpy()`` per variable),
``restore()`` assigns the copies back, ``sync()`` broadcasts rank 0's.

Sharded training keeps a commit whole, since a dead rank's shards die with it: a
``ShardedOptimizer`` (stages 1 and 2) commits its state gathered (tfops/sharding/elastic.py);
a ``tfops.fully_shard`` model commits its weights and its stage-3 optimizer's state gathered,
and its sync re-cuts the pieces for the new world (tfops/sharding/elastic_stage3.py). Both
send rank 0's last commit at a sync (the ranks' live shards may be cut for different worlds).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from allreduce import api as _api
from allreduce.elastic import ObjectState, world as _world

__all__ = ["TensorFlowState", "TensorFlowKerasState"]


def _values(variables) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables, values: list[np.ndarray], what: str) -> None:
    variables = list(variables)
    if not values and variables:             # committed before the optimizer was built: a fresh one
        values = [np.zeros(v.shape, v.dtype.as_numpy_dtype if hasattr(v.dtype, "as_numpy_dtype") else v.dtype)
                  for v in variables]
    if len(values) != len(variables):
        raise ValueError(f"rank {_api.rank()}: the {what} has {len(variables)} variables, the committed "
                         f"state {len(values)}; build it the same way on every rank before run()")
    for variable, value in zip(variables, values):
        variable.assign(value)


class TensorFlowState(ObjectState):
    """``tf.Variable`` objects plus keyword attributes (Horovod's ``TensorFlowState``).

    Args:
        variables: the variables to keep (default: none; ``tf.compat.v1.global_variables`` has no
            meaning in TensorFlow 2's eager mode).
        kwargs: attributes, as :class:`~allreduce.elastic.ObjectState`.
    """

    def __init__(self, variables=None, **kwargs: Any):
        self.variables = list(variables or [])
        self._saved_vars = _values(self.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        self._saved_vars = _values(self.variables)
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._saved_vars, "variable list")
        super().restore()

    def sync(self) -> None:
        self._saved_vars = _api.broadcast_object(_values(self.variables), 0)
        _assign(self.variables, self._saved_vars, "variable list")
        super().sync()


def _build_alone(optimizer, var_list) -> None:
    """Build a replacement's optimizer on this rank alone. ``DistributedOptimizer.build`` checks
    with an allgather that every rank trains the same shapes, but the other ranks built theirs
    before the replacement existed and will not join it; the shapes are checked here instead,
    by ``_assign`` (the count) and ``Variable.assign`` (each shape)."""
    from ..training import optimizer as module
    check = module._check_same_variables
    module._check_same_variables = lambda var_list: None
    try:
        optimizer.build(var_list)
    finally:
        module._check_same_variables = check


def _fully_sharded(model):
    """:mod:`tfops.sharding.elastic_stage3` for a ``tfops.fully_shard`` model, else None."""
    if getattr(model, "_tfops_fully_shard", None) is None:
        return None
    from ..sharding import elastic_stage3
    return elastic_stage3


class TensorFlowKerasState(ObjectState):
    """A Keras model's weights, its optimizer's variables and keyword attributes.

    Args:
        model: a Keras model (built: its weights exist).
        optimizer: its optimizer (default ``model.optimizer``).
        kwargs: attributes, as :class:`~allreduce.elastic.ObjectState` (``epoch=0, batch=0``).
    """

    def __init__(self, model, optimizer=None, **kwargs: Any):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_model = self._saved_opt = None
        self._stage3 = _fully_sharded(model)
        super().__init__(**kwargs)
        if not (self._stage3 and _world.joining()):   # a replacement's gathers would meet no one: the sync fills it
            self._save_tensors()

    def _opt_variables(self) -> list:
        return list(self.optimizer.variables) if self.optimizer is not None else []

    def _save_tensors(self, syncing: bool = False) -> None:
        if self._stage3:              # weights and state gathered whole (collectives); a sync sends the commit
            if not syncing:
                self._saved_model, self._saved_opt = self._stage3.save(self.model, self.optimizer)
            return
        self._saved_model = [np.array(w, copy=True) for w in self.model.get_weights()]
        sharded = getattr(self.optimizer, "elastic_save", None)   # tfops.ShardedOptimizer (tfops/sharding/elastic.py)
        if sharded is None:
            self._saved_opt = _values(self._opt_variables())
        elif not syncing:             # gathered whole (a collective); a sync sends the last commit's
            self._saved_opt = sharded()

    def _restore_tensors(self) -> None:
        if self._stage3:              # remembered; cut into the pieces (re-cut if the world changed) at the sync
            self._stage3.restore(self.model, self.optimizer, self._saved_model, self._saved_opt)
            return self._drop_train_function()
        self.model.set_weights(self._saved_model)
        if hasattr(self.optimizer, "elastic_restore"):          # re-sharded at its next step
            self.optimizer.elastic_restore(self._saved_opt)
            return self._drop_train_function()
        unbuilt = self.optimizer is not None and not getattr(self.optimizer, "built", True)
        if unbuilt and len(self._saved_opt) > len(self._opt_variables()):
            # a replacement (regrow) syncing before its first step: make the slots rank 0 has
            _build_alone(self.optimizer, self.model.trainable_variables)
        _assign(self._opt_variables(), self._saved_opt, "optimizer")

    def _drop_train_function(self) -> None:
        """Sharded layouts change at a reset: model.fit traces anew (the old trace holds the old pieces)."""
        if getattr(self.model, "train_function", None) is not None:
            self.model.train_function = None

    def save(self) -> None:
        self._save_tensors()
        super().save()

    def restore(self) -> None:
        self._restore_tensors()
        super().restore()

    def sync(self) -> None:
        self._save_tensors(syncing=True)   # what rank 0 holds now: its restored commit, or its starting weights
        self._saved_model, self._saved_opt = _api.broadcast_object((self._saved_model, self._saved_opt), 0)
        self._restore_tensors()
        if self._stage3:
            self._stage3.sync(self.model, self.optimizer)   # every rank: same model? re-cut, load
        super().sync()
