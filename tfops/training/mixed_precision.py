"""Loss scaling with a distributed optimizer, in either wrapping order: one structure, one decision.

Under ``keras.mixed_precision.set_global_policy("mixed_float16")`` a step scales the loss by
``S`` (so small fp16 gradients do not flush to zero), divides the gradients by ``S`` again, and
skips the step, halving ``S``, when a gradient is not finite. Keras 3's ``LossScaleOptimizer``
(LSO) does the last two in ``apply``; its ``scale_loss`` does the first. Two orders of wrapping::

    LSO(DistributedOptimizer(opt))     check finite -> unscale -> reduce -> opt.apply
    DistributedOptimizer(LSO(opt))     reduce -> check finite -> unscale -> opt.apply

The second breaks in ``model.compile``: with ``auto_scale_loss=True`` (the default) under
mixed_float16, compile wraps any optimizer that is not an LSO in a new one, so the loss is
scaled once (by the new LSO's ``S``) and the gradients are divided twice (by both ``S``): SGD
at 1/32768 the learning rate does not train, Adam (nearly scale-free) trains differently.

So the wrappers here turn the second order into the first (:func:`outside_loss_scale`):
``DistributedOptimizer(LSO(opt))`` returns ``LSO(DistributedOptimizer(opt))`` with the LSO's
settings, and the same for ``ShardedOptimizer``. Compile then sees an LSO and adds nothing,
and both orders are the same object graph as the plain ``LSO(opt)`` plus the reduction.

In that order the LSO checks each rank's *local* gradients before the reduction. A rank-local
inf would skip the step on that rank only, and the others would wait in the reduction for it
(their names match its next step's gradients: a silent mix of steps, then a hang). So every
rank must take the same decision: :func:`_check_finite_everywhere` replaces the LSO's
``check_finite`` (one class attribute, set when tfops is imported) with the same local check
followed, when the inner optimizer reduces across ranks, by one allreduce of the flag with
``Min`` over the ranks it reduces over. A step is applied only if every rank's gradients are
finite, as if the reduced gradients had been checked (a sum is finite when every term is,
barring an overflow of the sum itself, which the unscaled float32 gradients do not reach).
Any other LSO (single optimizer, a ``DistributedGradientTape``'s already reduced gradients)
is checked exactly as Keras does.

Cost: one 4-byte allreduce per step (one more engine round, ~0.1 ms on one node).
"""
from __future__ import annotations

import keras
import tensorflow as tf

import allreduce as ar

from ..collectives.dispatch import Min
from ..collectives.ops import allreduce
from ..collectives.process_sets import allreduce_in_set, is_global

__all__ = ["outside_loss_scale", "reduces_over"]

_LSO = keras.optimizers.LossScaleOptimizer
_keras_check_finite = _LSO.check_finite
_FINITE_NAME = "tfops.loss_scale.finite"     # one name, reused every step as gradient names are


def outside_loss_scale(optimizer, wrap):
    """``wrap(optimizer)``, or, for ``optimizer = LossScaleOptimizer(inner)``,
    ``LossScaleOptimizer(wrap(inner))`` with the same ``initial_scale``, ``dynamic_growth_steps``
    and name (an LSO already built keeps its current scale as the new one's initial scale).

    Args:
        optimizer: a Keras 3 optimizer, possibly a ``keras.optimizers.LossScaleOptimizer``.
        wrap: the distributed wrapper, called with the optimizer to reduce for.
    """
    if not isinstance(optimizer, _LSO):
        return wrap(optimizer)
    scale = optimizer.initial_scale
    if optimizer.built:
        scale = float(optimizer.dynamic_scale.numpy())
    return _LSO(wrap(optimizer.inner_optimizer), initial_scale=scale,
                dynamic_growth_steps=optimizer.dynamic_growth_steps, name=optimizer.name)


def reduces_over(optimizer):
    """The process set a tfops optimizer reduces gradients over (``None``: every rank), or
    ``False`` when ``optimizer`` does not reduce across ranks."""
    names = {cls.__name__ for cls in type(optimizer).__mro__}
    if "DistributedOptimizerWrapper" in names:
        if optimizer._hooks is not None:
            return None
        return optimizer._settings.process_set
    if "ShardedOptimizerWrapper" in names:
        return getattr(optimizer, "process_set", None)
    return False


def _check_finite_everywhere(self, grads):
    """``LossScaleOptimizer.check_finite`` that every rank the inner optimizer reduces over
    answers alike: True only if every rank's gradients are finite (module docstring)."""
    finite = _keras_check_finite(self, grads)
    process_set = reduces_over(self.inner_optimizer)
    if process_set is False or ar.size() == 1:
        return finite
    flag = tf.cast(finite, tf.int32)
    if process_set is None or is_global(process_set):
        everywhere = allreduce(flag, op=Min, name=_FINITE_NAME)
    else:
        everywhere = allreduce_in_set(flag, op=Min, process_set=process_set)
    return tf.equal(everywhere, 1)


_LSO.check_finite = _check_finite_everywhere
