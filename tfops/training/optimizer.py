"""``DistributedOptimizer``: a Keras 3 optimizer that averages gradients across ranks before applying them.

::

    opt = tfops.DistributedOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(..., callbacks=[tfops.keras.callbacks.BroadcastGlobalVariablesCallback(0)])

The wrapper is one class, defined here (not built at run time): it owns the
inner optimizer, as ``keras.optimizers.LossScaleOptimizer`` does, and
forwards ``learning_rate``, ``iterations``, ``scale_loss`` and the optimizer
state to it. ``apply`` reduces the step's gradients (:mod:`tfops.training.grad_reduce`:
local variables, ``gradient_predivide_factor``, ``num_groups``), then calls
the inner ``apply``. Horovod's Keras entry points work too:
``compute_gradients`` / ``_compute_gradients(loss, var_list, tape=)`` reduce
and return ``(gradient, variable)`` pairs, and ``apply_gradients`` then
applies them without reducing again.

With ``backward_passes_per_step=N`` the gradients are summed locally for N
passes and reduced (and applied) on every N-th (:mod:`tfops.training.aggregation`).

``hooks=tfops.GradientHooks(model)`` (not in Horovod) starts each gradient's
allreduce during backprop instead (:mod:`tfops.training.hooks`); ``apply`` then only
waits for the handles.
"""
from __future__ import annotations

import keras
import tensorflow as tf

import allreduce as ar
from allreduce.errors import MismatchError
from allreduce.ops import Adasum

from .aggregation import LocalAggregation
from .grad_reduce import GradientSettings, reduce_step
from .mixed_precision import outside_loss_scale
from .wrapping import WrappingOptimizer
from ..collectives.compression import Compression
from ..collectives.dispatch import Average, Sum, check_op

__all__ = ["DistributedOptimizer", "DistributedOptimizerWrapper"]


@keras.saving.register_keras_serializable(package="tfops", name="DistributedOptimizer")
class DistributedOptimizerWrapper(WrappingOptimizer):
    """The wrapper :func:`DistributedOptimizer` returns. ``inner_optimizer`` does the update."""

    def __init__(self, inner_optimizer, *, name=None, compression=Compression.none, sparse_as_dense=False,
                 op=Average, backward_passes_per_step=1, average_aggregated_gradients=False, hooks=None,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=None,
                 scale_local_gradients=True, comm_hook=None):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer (Keras 3), got "
                            f"{type(inner_optimizer).__name__}; tf.compat.v1 and Keras 2 legacy optimizers "
                            "are not supported")
        op = check_op(op)
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"DistributedOptimizer supports op=Average, Sum or Adasum, got {op!r}")
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if hooks is not None and comm_hook is not None:
            raise ValueError("pass comm_hook= to the GradientHooks (GradientHooks(model, comm_hook=...)), which "
                             "reduce the gradients when hooks= is given, not to the optimizer")
        if hooks is not None and int(backward_passes_per_step) > 1:
            raise ValueError("hooks reduce every backward pass as it happens; they cannot be combined with "
                             "backward_passes_per_step > 1, which reduces once per N passes")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{inner_optimizer.name}")
        self.inner_optimizer = inner_optimizer
        self._settings = GradientSettings(op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
                                          gradient_predivide_factor=gradient_predivide_factor,
                                          num_groups=int(num_groups or 0), groups=groups, process_set=process_set,
                                          scale_local_gradients=bool(scale_local_gradients), comm_hook=comm_hook)
        self._settings.check("DistributedOptimizer")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self._agg_helper = (LocalAggregation(self.backward_passes_per_step, self.average_aggregated_gradients)
                            if self.backward_passes_per_step > 1 else None)
        self._hooks = None if hooks is None else hooks.install()
        self._reduced_by_compute = False

    op = property(lambda self: self._settings.op)
    compression = property(lambda self: self._settings.compression)
    comm_hook = property(lambda self: self._settings.comm_hook)
    sparse_as_dense = property(lambda self: self._settings.sparse_as_dense)

    def build(self, var_list):
        _check_same_variables(var_list)
        self.inner_optimizer.build(var_list)
        if self._agg_helper is not None:
            self._agg_helper.build(self, var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables[:] + self.inner_optimizer.variables

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (divided by ``size()``, Horovod's ``scale_local_gradients``)."""
        if self._hooks is not None:
            raise ValueError("register_local_var: hooks reduce every gradient during backprop; "
                             "use the optimizer without hooks= for local variables")
        self._settings.register_local(var)

    # -- Horovod's Keras entry points: compute (and reduce), then apply -------------------
    def compute_gradients(self, loss, var_list, tape=None):
        """``(gradient, variable)`` pairs of ``loss`` (a tensor recorded on ``tape``, or a callable), reduced."""
        return self._compute_gradients(loss, var_list, tape=tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        variables = tf.nest.flatten(var_list)
        if callable(loss):
            tape = tf.GradientTape() if tape is None else tape
            with tape:
                tape.watch(variables)
                loss = loss()
        elif tape is None:
            raise ValueError("compute_gradients: a loss tensor needs the tape that recorded it (tape=)")
        grads = tape.gradient(loss, variables, output_gradients=grad_loss)
        self._build_once(variables)
        reduced = self._reduce(list(grads), variables)
        self._reduced_by_compute = True
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, **kwargs):
        """Apply ``(gradient, variable)`` pairs (Keras 2 keywords such as
        ``experimental_aggregate_gradients`` are accepted and ignored)."""
        grads, variables = zip(*list(grads_and_vars))
        self.apply(list(grads), list(variables))
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Reduce ``grads`` over all ranks (every N-th call with ``backward_passes_per_step=N``), then apply."""
        if trainable_variables is None and not self.built:
            raise ValueError("build the optimizer first, or pass trainable_variables")
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        self._build_once(variables)
        grads = list(grads)
        if self._reduced_by_compute:
            self._reduced_by_compute = False        # compute_gradients already reduced (and aggregated)
        else:
            grads = self._reduce(grads, variables)
        if self._agg_helper is None:
            self.inner_optimizer.apply(grads, variables)
        else:
            self._agg_helper.apply(lambda: self.inner_optimizer.apply(grads, variables), self.iterations)

    def _build_once(self, variables) -> None:
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(list(variables))

    def _reduce(self, grads, variables):
        if self._hooks is not None:
            return self._hooks.wait(grads)

        def reduce(gs):
            return reduce_step(gs, variables, self._settings, "optimizer")
        if self._agg_helper is not None:
            return self._agg_helper.step(grads, variables, reduce)
        return reduce(grads)

    # -- what belongs to the inner optimizer ---------------------------------------------
    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        s = self._settings
        return {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "sparse_as_dense": s.sparse_as_dense, "op": int(s.op),
                "backward_passes_per_step": self.backward_passes_per_step,
                "average_aggregated_gradients": self.average_aggregated_gradients,
                "gradient_predivide_factor": s.gradient_predivide_factor,
                "num_groups": s.groups if isinstance(s.groups, int) else 0,
                "scale_local_gradients": s.scale_local_gradients}

    @staticmethod
    def _settings_from_config(config: dict) -> dict:
        return {**config, "op": ar.Op(config["op"]) if "op" in config else Average}   # JSON holds the op's value


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


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None, scale_local_gradients=True, hooks=None,
                         comm_hook=None):
    """Wrap a Keras 3 optimizer so it reduces gradients across ranks (``hvd.DistributedOptimizer``).

    The argument order is ``horovod.tensorflow.DistributedOptimizer``'s; ``tfops.keras`` has
    ``horovod.tensorflow.keras``'s order (:func:`tfops.keras.DistributedOptimizer`).

    Args:
        optimizer: any ``keras.optimizers.Optimizer`` (SGD, Adam, AdamW, ...).
        name: the wrapper's name; default ``"Distributed" + optimizer.name``.
        use_locking, device_dense, device_sparse: accepted for Horovod compatibility; unused
            (no TF1 locking; the engine reduces in host memory).
        compression: ``Compression.none`` (default), ``fp16`` or ``bf16`` for dense gradients.
        sparse_as_dense: densify ``IndexedSlices`` gradients instead of allgathering them.
        backward_passes_per_step: accumulate this many gradients locally per reduction and update.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with ``Average``: multiply by ``1/f`` before the sum and by
            ``f/size`` after it.
        average_aggregated_gradients: divide the accumulated gradients by ``backward_passes_per_step``.
        num_groups, groups: split the gradients into this many groups (or these lists of
            variables), each reduced as one grouped allreduce.
        process_set: reduce over this :class:`tfops.ProcessSet` only (default: all ranks); a rank
            outside the set keeps its own gradients, as in Horovod.
        scale_local_gradients: divide registered local variables' gradients by ``size()``.
        hooks: a :class:`tfops.GradientHooks` on the model (not in Horovod): every forward pass is
            hooked and each gradient's allreduce starts during backprop; ``apply`` waits for them.
            Their own ``op``/``compression``/``comm_hook`` apply.
        comm_hook: not in Horovod: a communication hook, ``tfops.PowerSGD(rank=2)`` or
            ``tfops.OneBit()``, that reduces the dense gradients (each bucket, overlapping backprop
            in ``model.fit``) in place of the plain allreduce; not with ``compression``, Adasum or a
            predivide. Its state (error feedback, warm-start factors) lives in the hook object.

    Returns:
        The wrapped optimizer, for ``model.compile(optimizer=...)`` or ``apply_gradients``. For a
        ``keras.optimizers.LossScaleOptimizer(opt)``: ``LossScaleOptimizer(DistributedOptimizer(opt))``
        (the loss-scaled order compile keeps; :mod:`tfops.training.mixed_precision`).
    """
    return outside_loss_scale(optimizer, lambda inner: DistributedOptimizerWrapper(
        inner, name=name, compression=compression, sparse_as_dense=sparse_as_dense, op=op,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        hooks=hooks, gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients, comm_hook=comm_hook))
