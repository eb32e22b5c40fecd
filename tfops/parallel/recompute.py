"""Selective activation recompute: keep a function's inputs, recompute its inside in backprop.

Backprop needs every activation the forward pass made. Full recompute (``keras.RematScope``,
``keras.remat``: ``tf.recompute_grad``) keeps only each layer's input and runs the layer again
in backprop: one more forward pass of compute. Korthikanti et al. (2022, "Reducing Activation
Recomputation in Large Transformer Models") recompute only the attention core, whose
activations are large and cheap to remake::

    forward:    q, k, v ──> [ s = q kᵀ/√d  (b·a·L² values)  p = softmax(s)  (b·a·L²) ] ──> o = p v
                keep:   q, k, v (3·b·L·h)                   drop: s, p  (2·b·a·L², L² in sequence length)
    backprop:   dO ──> recompute s, p from the kept q, k, v ──> dq, dk, dv

Per layer of a GPT (sequence L, batch b, hidden h, a heads, 2-byte activations) that drops
5·a·L²·b of Korthikanti's 34·L·b·h + 5·a·L²·b bytes, for the cost of the core's forward again
(about 2·L²·h of the layer's 24·L·h² + 4·L²·h multiply-adds: ~3% at L = 2048, h = 12288).

:func:`selective_recompute` is a ``tf.custom_gradient`` over tensors only: the recomputed
function must read no variables (the attention core reads none). So it works unchanged with
every distributed path: ``DistributedOptimizer``, ``GradientHooks`` (their hooks are on the
weight reads, outside the core), ``ShardedOptimizer`` and ``fully_shard``, the tensor-parallel
layers (their region operators are outside it too) and the pipeline (a stage's backward calls
the same gradient). A function that reads a variable raises ``ValueError`` naming it, rather
than silently giving that variable no gradient. Cost: one more forward of the core in backprop.
"""
from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.eager import record

__all__ = ["selective_recompute"]


def selective_recompute(fn):
    """Wrap ``fn`` (tensors in, a tensor or a tuple of tensors out, no variables read) so that its
    intermediate activations are not kept for backprop but recomputed from its inputs.

    Args:
        fn: a function of tensors only, e.g. the attention core ``(q, k, v) -> softmax(q kᵀ) v``.
            Non-tensor settings go in a closure or ``functools.partial``.

    Returns:
        A function with ``fn``'s signature (positional tensors) whose gradient is ``fn``'s,
        computed by running ``fn`` again in backprop.
    """
    @functools.wraps(fn)
    def wrapper(*args):
        args = [tf.convert_to_tensor(a) for a in args]
        return _recomputed(fn, *args)
    return wrapper


def _recomputed(fn, *args):
    @tf.custom_gradient
    def run(*xs):
        with record.VariableWatcher() as watcher, record.stop_recording():   # no tape keeps the inside
            out = fn(*xs)
        read = watcher.watched_variables()
        if read:
            raise ValueError(f"selective_recompute: {getattr(fn, '__name__', fn)} reads variables "
                             f"({', '.join(v.name for v in read[:3])}); it may only compute on its tensor inputs "
                             "(pass the weights' products in, or use keras.remat for a whole layer)")

        def grad(*dys):
            with tf.GradientTape() as tape:
                again_in = [tf.identity(x) for x in xs]
                if not tf.executing_eagerly():             # after dys, and not merged with the forward by
                    dep = _after(dys[0])                   # common-subexpression elimination (as tf.recompute_grad)
                    again_in = [x + tf.cast(dep, x.dtype) for x in again_in]
                tape.watch(again_in)
                again = fn(*again_in)                      # the activations, made again
            many = isinstance(again, (list, tuple))
            return tape.gradient(again, again_in, output_gradients=list(dys) if many else dys[0],
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return out, grad
    return run(*args)


def _after(dy: tf.Tensor) -> tf.Tensor:
    """A scalar 0 that depends on ``dy`` (one element read): NaN-safe, as ``tf.recompute_grad``'s."""
    first = tf.reduce_max(tf.reshape(dy, [-1])[:1])
    same = tf.cast(first, tf.bool)
    return tf.where(tf.equal(same, same), 0.0, float("nan"))
