"""Cross-entropy over logits split by vocabulary over the tensor group, without ever gathering them
(Megatron's ``cross_entropy.py``).

Each rank holds ``logits[..., V/t]``, the columns ``[start, start + V/t)`` of the full row. The loss
``log(sum_j exp(z_j)) - z_label`` needs three numbers per row, each one allreduce of a
(batch, seq) array, never of the (batch, seq, V) logits:

    1. m      = max over the group of each rank's row max        (allreduce Max; for exp's range only)
    2. z_lab  = sum over the group of (z_label - m if the label is mine, else 0)   (allreduce Sum)
    3. S      = sum over the group of each rank's sum_j exp(z_j - m)               (allreduce Sum)
    loss = log(S) - z_lab

Backward is local, no communication: d loss / d z_j = softmax_j - [j == label], and each rank has
its own columns' softmax (exp(z_j - m) / S) and knows whether the label is one of them.

Cost: 3 allreduces of batch x seq floats forward; memory one (batch, seq, V/t) softmax per rank.
"""
from __future__ import annotations

import tensorflow as tf

from . import regions
from .init import mesh_or_default

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(logits, labels, mesh=None):
    """Per-token cross-entropy of vocabulary-split ``logits`` against full-vocabulary ``labels``.

    Args:
        logits: ``(..., V / tensor)`` floats: this rank's columns (a ``ColumnParallelDense`` output,
            ``gather_output=False``), columns ``[tensor_rank * V/t, (tensor_rank + 1) * V/t)``.
        labels: ``(...)`` integer ids in ``[0, V)``.
        mesh: a :class:`~tfops.parallel.Mesh` (default: the last one built).

    Returns:
        ``(...)`` losses, the same on every rank of the tensor group (equal to
        ``keras.losses.sparse_categorical_crossentropy(labels, full_logits, from_logits=True)``).
    """
    mesh = mesh_or_default(mesh)
    logits = tf.convert_to_tensor(logits)
    width = logits.shape[-1]
    start = width * mesh.tensor_rank
    local = tf.cast(labels, tf.int32) - start
    mine = (local >= 0) & (local < width)
    onehot = tf.one_hot(tf.where(mine, local, 0), width, dtype=logits.dtype) * tf.cast(mine, logits.dtype)[..., None]

    @tf.custom_gradient
    def loss(logits):
        m = regions.allreduce_max(tf.reduce_max(logits, axis=-1), mesh, "loss: max")    # 1. max
        z = logits - m[..., None]
        z_label = regions.allreduce_sum(tf.reduce_sum(z * onehot, axis=-1), mesh, "loss: target")    # 2.
        exp = tf.exp(z)
        with tf.control_dependencies([z_label]):     # 2 before 3 on every rank: two same-shaped sums on one group
            total = regions.allreduce_sum(tf.reduce_sum(exp, axis=-1), mesh, "loss: sum exp")    # 3.
        softmax = exp / total[..., None]

        def grad(dy):                                # local: softmax minus my columns' one-hot
            return (softmax - onehot) * tf.convert_to_tensor(dy)[..., None]
        return tf.math.log(total) - z_label, grad
    return loss(logits)
