"""``SyncBatchNormalization``: batch normalization whose batch statistics cover every rank's batch.

::

    rank r:  n_r = count,  s_r = sum(x),  q_r = sum(x * x)     (per channel, over the reduced axes)
             [n, s, q] = allreduce([n_r, s_r, q_r], Sum)        one grouped allreduce per call
             mean = s / n,  variance = q / n - mean^2

With p ranks of batch b each, training normalizes with the statistics of the
global batch p*b, as one process holding all of it would (Keras' own
``BatchNormalization`` on the concatenated batch); the moving mean and
variance then agree on every rank. Counts are summed, so ranks with batches of
different sizes weigh in by their size (Horovod's version averages the
ranks' moments, which assumes equal batches). A mask (``call(..., mask=)``)
counts only the unmasked entries, as Keras does.

Cost per call in training: one allreduce of ``2C + 1`` numbers (C channels)
and its gradient in backprop (the allreduce's gradient is an allreduce: the
statistics' gradients from every rank's loss reach every rank). Inference
uses the moving statistics and no communication. On one rank it is Keras'
``BatchNormalization`` exactly.
"""
from __future__ import annotations

import keras
import tensorflow as tf

import allreduce as ar

from ..collectives.dispatch import Sum
from ..collectives.ops import grouped_allreduce

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="tfops")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with the batch mean and variance reduced over all ranks.

    Takes the arguments of ``keras.layers.BatchNormalization`` (``axis``, ``momentum``,
    ``epsilon``, ``center``, ``scale``, initializers, ...); ``synchronized=`` is Keras'
    own ``tf.distribute`` switch and is not used here. ``fused=`` (Keras 2) is accepted and ignored.
    """

    def __init__(self, *args, fused=None, **kwargs):
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization already synchronizes over tfops ranks; "
                             "synchronized=True (tf.distribute) cannot be combined with it")
        super().__init__(*args, **kwargs)

    def _moments(self, inputs, mask):
        if ar.size() == 1:
            return super()._moments(inputs, mask)
        compute = tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else inputs.dtype
        x = tf.cast(inputs, compute)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), compute)
        axes = list(self._reduction_axes)
        count = tf.reduce_sum(weights, axis=axes)
        total = tf.reduce_sum(weights * x, axis=axes)
        squares = tf.reduce_sum(weights * tf.square(x), axis=axes)
        count, total, squares = grouped_allreduce([count, total, squares], op=Sum)
        count = tf.maximum(count, 1.0)
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
