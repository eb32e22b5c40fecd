"""True norms of tensors cut into shards: each rank sums the squares of its segments, one allreduce
of an n-vector (n = the model's variable count) adds the ranks' partial sums.

Used by ``clipnorm`` (each variable's gradient clipped by its own norm), ``global_clipnorm`` (all
gradients by their joint norm) and Lamb (each variable's trust ratio ``|w| / |update|``). A norm
computed on one shard alone would differ from rank to rank and from unsharded training; with the
partial sums reduced, every rank clips (or scales) its segment by the factor unsharded Keras uses,
in Keras' own formula (``tf.clip_by_norm``, ``clip_by_global_norm``, ``Lamb.update_step``).
Cost: one allreduce of ``n`` floats (``2n`` for Lamb) per step, alpha-bound.
"""
from __future__ import annotations

import tensorflow as tf

from .exchange import allreduce_sum

__all__ = ["squared_norms", "clip_segments"]


def squared_norms(parts: list[list[tf.Tensor]], owners: list[int], n_vars: int, *, comm=None) -> list[tf.Tensor]:
    """For each list in ``parts`` (one tensor per segment, segment k a piece of variable
    ``owners[k]``): the squared norm of each whole variable, summed over every rank's pieces.
    Returns one float32 ``[n_vars]`` tensor per list; all lists go in one allreduce over ``comm``
    (the shards' communicator; default the world's)."""
    vectors = []
    for tensors in parts:
        sums = [tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors]
        vec = tf.zeros([n_vars], tf.float32)
        if sums:
            vec = tf.tensor_scatter_nd_add(vec, [[v] for v in owners], tf.stack(sums))
        vectors.append(vec)
    total = allreduce_sum(tf.concat(vectors, 0), comm=comm)
    return [total[i * n_vars:(i + 1) * n_vars] for i in range(len(parts))]


def clip_segments(grads: list[tf.Tensor], owners: list[int], n_vars: int, *, clipnorm=None,
                  global_clipnorm=None, comm=None) -> list[tf.Tensor]:
    """``grads`` (this rank's segments) clipped as Keras clips the whole gradients."""
    if not clipnorm and not global_clipnorm:
        return grads
    (sq,) = squared_norms([grads], owners, n_vars, comm=comm)
    if clipnorm:                                    # tf.clip_by_norm on each whole variable
        out = []
        for g, v in zip(grads, owners):
            l2sum = tf.cast(sq[v], g.dtype)
            l2norm = tf.where(l2sum > 0, tf.sqrt(tf.where(l2sum > 0, l2sum, tf.ones_like(l2sum))), l2sum)
            clip = tf.cast(clipnorm, g.dtype)
            out.append(g * clip / tf.maximum(l2norm, clip))
        return out
    use_norm = tf.sqrt(tf.reduce_sum(sq))          # keras clip_by_global_norm
    scale = global_clipnorm * tf.minimum(1.0 / use_norm, 1.0 / global_clipnorm)
    scale = scale + (use_norm - use_norm)
    return [g * tf.cast(scale, g.dtype) for g in grads]
