"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns averaged gradients.

::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = tfops.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # reduced over all ranks

Backprop runs first, then every dense gradient goes to the engine in one
grouped call (sparse ones are allgathered). For communication that overlaps
backprop, see :mod:`tfops.hooks`.
"""
from __future__ import annotations

import tensorflow as tf

from .gradients import gradient_names, reduce_gradients
from .ops import Average, Compression, Sum, _check_op, check_compression

__all__ = ["DistributedGradientTape"]


class DistributedGradientTape:
    """Wrap ``gradtape`` so :meth:`gradient` reduces the gradients across ranks.

    Every other attribute (``watch``, ``stop_recording``, ...) is the wrapped tape's.

    Args:
        gradtape: a ``tf.GradientTape`` (inside or after its ``with`` block).
        compression: ``Compression.none`` (default), ``fp16`` or ``bf16`` for the dense gradients.
        sparse_as_dense: densify ``IndexedSlices`` gradients (embeddings) before reducing.
        op: ``Average`` (default) or ``Sum``.
    """

    def __init__(self, gradtape: tf.GradientTape, compression=Compression.none,
                 sparse_as_dense: bool = False, op=Average):
        op = _check_op(op)
        if op not in (Average, Sum):
            raise ValueError(f"DistributedGradientTape supports op=Average or Sum, got {op!r}")
        self._tape = gradtape
        self._compression = check_compression(compression)
        self._sparse_as_dense = sparse_as_dense
        self._op = op

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """``tape.gradient(...)``, then the gradients reduced over all ranks (same structure)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        reduced = reduce_gradients(flat, gradient_names("tape", len(flat_sources)), op=self._op,
                                   compression=self._compression, sparse_as_dense=self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, reduced)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)

