"""Local gradient aggregation: ``backward_passes_per_step=N`` (Horovod's LocalGradientAggregationHelper).

::

    pass:        1        2        ...      N                      N+1
    accumulate:  a += g   a += g            a += g                 a += g   (a was zeroed)
    counter:     1        2                 N -> 0                 1
    reduce:      -        -                 reduce_step(a) [/ N]   -
    apply:       -        -                 inner.apply            -
    iterations:  +1       +1                +1 (by the apply)      +1

Every pass adds its gradients into one accumulator per variable (a sparse
gradient is densified into it) and counts. On the N-th pass the sums are
reduced across ranks, divided by N with ``average_aggregated_gradients``,
the accumulators are set to zero (an ``inf`` or ``nan`` of this cycle does
not leak into the next: they are assigned zeros, not multiplied by zero) and
the counter goes back to 0; the optimizer then applies them. The other passes
return the local sums and only advance ``iterations``, as Horovod's do, so
``iterations`` counts backward passes.

Cost: 1/N of the communication of ``N = 1``; one variable per trainable
variable of memory. The branch is a ``tf.cond``, so it works eagerly, in
``tf.function`` and in ``model.fit``; every rank takes the same branch since
the counters advance together.
"""
from __future__ import annotations

import tensorflow as tf

from .grad_reduce import source_key

__all__ = ["LocalAggregation"]


class LocalAggregation:
    """The optimizer's ``_agg_helper``: accumulators and ``counter`` for ``backward_passes_per_step``.

    Args:
        backward_passes_per_step: N, the passes per reduction (>= 2).
        average_aggregated_gradients: divide the reduced sums by N.
    """

    def __init__(self, backward_passes_per_step: int, average_aggregated_gradients: bool):
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.counter = None
        self._accumulated = {}          # source_key(variable) -> accumulator variable

    def build(self, optimizer, var_list) -> None:
        """Create the counter and one zeroed accumulator per variable (optimizer variables: checkpointed)."""
        self.counter = optimizer.add_variable(shape=(), dtype="int64", name="backward_passes",
                                              initializer="zeros")
        for v in var_list:
            self._accumulated[source_key(v)] = optimizer.add_variable_from_reference(
                v, name="accumulated_gradient")

    def step(self, grads: list, variables: list, reduce_fn) -> list:
        """Add ``grads`` in; on the N-th pass return ``reduce_fn(sums)`` (and reset), else the local sums."""
        slots = []
        for g, v in zip(grads, variables):
            if g is None:
                continue
            acc = self._accumulated.get(source_key(v))
            if acc is None:
                raise ValueError(f"backward_passes_per_step: no accumulator for variable {v.name!r}: pass the "
                                 "same variables on every step as when the optimizer was built")
            acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))
            slots.append(acc)
        count = self.counter.assign_add(1)
        present = [i for i, g in enumerate(grads) if g is not None]

        def reduce():
            sums = [None] * len(grads)
            for i, acc in zip(present, slots):
                sums[i] = tf.convert_to_tensor(acc)
            reduced = reduce_fn(sums)
            if self.average_aggregated_gradients:
                scale = 1.0 / self.backward_passes_per_step
                reduced = [None if r is None else r * tf.cast(scale, r.dtype) for r in reduced]
            out = [tf.convert_to_tensor(reduced[i]) for i in present]
            with tf.control_dependencies(out):
                for acc in slots:
                    acc.assign(tf.zeros_like(acc))
                self.counter.assign(0)
                return [tf.identity(o) for o in out]

        def keep():
            return [tf.convert_to_tensor(acc) for acc in slots]

        if not present:
            return list(grads)
        values = tf.cond(count >= self.backward_passes_per_step, reduce, keep)
        out = list(grads)
        for i, v in zip(present, values):
            out[i] = v
        return out

    def apply(self, apply_fn, iterations) -> None:
        """Run ``apply_fn`` on the pass that reduced (counter back at 0); otherwise count the pass."""
        def run():
            apply_fn()
            return tf.constant(True)

        def skip():
            iterations.assign_add(1)
            return tf.constant(False)
        tf.cond(tf.equal(self.counter, 0), run, skip)
