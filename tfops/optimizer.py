"""``DistributedOptimizer``: a Keras 3 optimizer that averages gradients across ranks before applying them.

::

    opt = tfops.DistributedOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(..., callbacks=[tfops.keras.callbacks.BroadcastGlobalVariablesCallback(0)])

The wrapper is one class, defined here (not built at run time): it owns the
inner optimizer, as ``keras.optimizers.LossScaleOptimizer`` does, and
forwards ``learning_rate``, ``iterations``, ``scale_loss`` and the optimizer
state to it. ``apply`` reduces the step's dense gradients in one grouped
call, allgathers sparse ones, then calls the inner ``apply``.

With ``backward_passes_per_step=N`` the gradients are summed locally for N
calls and reduced (and applied) on every N-th: 1/N of the communication.
Horovod sums them by default; ``average_aggregated_gradients=True`` divides
by N, so N micro-batches equal one N-times larger batch.

``hooks=tfops.GradientHooks(model)`` (not in Horovod) starts each gradient's
allreduce during backprop instead (:mod:`tfops.hooks`); ``apply`` then only
waits for the handles.
"""
from __future__ import annotations

import keras
import tensorflow as tf

import allreduce as ar
from allreduce.errors import MismatchError

from .gradients import gradient_names, reduce_gradients
from .ops import Average, Compression, Sum, _check_op, check_compression

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(keras.optimizers.Optimizer):
    """The wrapper :func:`DistributedOptimizer` returns. ``inner_optimizer`` does the update."""

    def __init__(self, inner_optimizer, *, name=None, compression=Compression.none, sparse_as_dense=False,
                 op=Average, backward_passes_per_step=1, average_aggregated_gradients=False, hooks=None):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        op = _check_op(op)
        if op not in (Average, Sum):
            raise ValueError(f"DistributedOptimizer supports op=Average or Sum, got {op!r}")
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if hooks is not None and int(backward_passes_per_step) > 1:
            raise ValueError("hooks reduce every backward pass as it happens; they cannot be combined with "
                             "backward_passes_per_step > 1, which reduces once per N passes")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{inner_optimizer.name}")
        self.inner_optimizer = inner_optimizer
        self.compression = check_compression(compression)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self._hooks = None if hooks is None else hooks.install()

    def build(self, var_list):
        _check_same_variables(var_list)
        self.inner_optimizer.build(var_list)
        if self.backward_passes_per_step > 1:
            self._accumulated = [self.add_variable_from_reference(v, name="accumulated_gradient")
                                 for v in var_list]
            self._passes = self.add_variable(shape=(), dtype="int64", name="backward_passes")
        super().build(var_list)

    @property
    def variables(self):
        return self._variables[:] + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        """Reduce ``grads`` over all ranks (every N-th call with ``backward_passes_per_step=N``), then apply."""
        if not self.built:
            if trainable_variables is None:
                raise ValueError("build the optimizer first, or pass trainable_variables")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        grads = list(grads)
        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(self._reduce(grads, variables), variables)
            return
        for acc, g in zip(self._accumulated, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        passes = self._passes.assign_add(1)
        keras.ops.cond(tf.equal(passes % self.backward_passes_per_step, 0),
                       lambda: self._apply_accumulated(grads, variables), lambda: None)

    def _apply_accumulated(self, grads, variables):
        scale = 1.0 / self.backward_passes_per_step if self.average_aggregated_gradients else 1.0
        summed = [None if g is None else tf.convert_to_tensor(acc) * tf.cast(scale, acc.dtype)
                  for g, acc in zip(grads, self._accumulated)]
        self.inner_optimizer.apply(self._reduce(summed, variables), variables)
        for acc in self._accumulated:
            acc.assign(tf.zeros_like(acc))
        return None

    def _reduce(self, grads, variables):
        if self._hooks is not None:
            return self._hooks.wait(grads)
        return reduce_gradients(grads, gradient_names("optimizer", len(variables)), op=self.op,
                                compression=self.compression, sparse_as_dense=self.sparse_as_dense)

    # -- what belongs to the inner optimizer ---------------------------------------------
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "sparse_as_dense": self.sparse_as_dense, "op": int(self.op),
                "backward_passes_per_step": self.backward_passes_per_step,
                "average_aggregated_gradients": self.average_aggregated_gradients}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def _check_same_variables(var_list) -> None:
    """Once, when the optimizer is built: every rank must train the same shapes, or no step can match."""
    if ar.size() == 1:
        return
    mine = [(tuple(v.shape), str(v.dtype)) for v in var_list]
    everyone = ar.allgather_object(mine)
    bad = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if bad:
        detail = "; ".join(f"rank {r}: {len(everyone[r])} variables {everyone[r][:4]}" for r in [0] + bad)
        raise MismatchError(f"DistributedOptimizer: ranks train different variables ({detail}). Build the same "
                            "model on every rank before compiling or applying gradients.")


def DistributedOptimizer(optimizer, name=None, compression=Compression.none, sparse_as_dense=False,
                         op=Average, backward_passes_per_step=1, average_aggregated_gradients=False, hooks=None):
    """Wrap a Keras 3 optimizer so it reduces gradients across ranks (``hvd.DistributedOptimizer``).

    Args:
        optimizer: any ``keras.optimizers.Optimizer`` (SGD, Adam, AdamW, ...).
        name: the wrapper's name; default ``"Distributed" + optimizer.name``.
        compression: ``Compression.none`` (default), ``fp16`` or ``bf16`` for dense gradients.
        sparse_as_dense: densify ``IndexedSlices`` gradients instead of allgathering them.
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: accumulate this many gradients locally per reduction and update.
        average_aggregated_gradients: divide the accumulated gradients by ``backward_passes_per_step``.
        hooks: a :class:`tfops.GradientHooks` on the model (not in Horovod): every forward pass is
            hooked and each gradient's allreduce starts during backprop; ``apply`` waits for them.
            Their own ``op``/``compression`` apply.

    Returns:
        The wrapped optimizer, for ``model.compile(optimizer=...)`` or ``apply_gradients``.
    """
    return _DistributedOptimizer(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                                 op=op, backward_passes_per_step=backward_passes_per_step,
                                 average_aggregated_gradients=average_aggregated_gradients, hooks=hooks)
