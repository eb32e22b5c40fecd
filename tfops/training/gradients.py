"""One step's gradients, reduced together: shared by the tape, the optimizer and the hooks.

Dense gradients go to the engine in one grouped call (the engine fuses
them); ``IndexedSlices`` (embedding gradients) are allgathered, values and
indices, or densified first with ``sparse_as_dense=True``. Names are
positions, the same on every rank.
"""
from __future__ import annotations

import tensorflow as tf

import allreduce as ar

from ..collectives.compression import Compression
from ..collectives.dispatch import Average, grouped_dense, plain_python
from ..collectives.ops import allreduce
from .overlap import reduce_overlapped

__all__ = ["reduce_gradients"]


@plain_python
def reduce_gradients(grads, names: list[str], op=Average, compression=Compression.none,
                     sparse_as_dense: bool = False, overlap: bool = False, comm_hook=None) -> list:
    """Reduce a step's gradients: every dense one in ONE grouped call, sparse ones allgathered.

    Args:
        grads: tensors, ``tf.IndexedSlices`` or ``None`` (kept as ``None``).
        names: one cross-rank name per gradient (:func:`tfops.training.grad_reduce.gradient_names`).
        op: ``Sum`` or ``Average``, as :class:`~tfops.training.grad_reduce.GradientSettings` checked it.
        compression: applied to the dense gradients (an engine compressor, checked there too).
        comm_hook: a communication hook (``ar.PowerSGD``, ``ar.OneBit``) that reduces the dense
            gradients instead, one bucket (grouped call) at a time; ``None``: the plain allreduce.
        sparse_as_dense: densify ``IndexedSlices`` and reduce them with the dense ones.
        overlap: inside a graph (``tf.function``, ``model.fit``), reduce the dense ones in
            buckets submitted as backprop produces them (:mod:`tfops.training.overlap`) instead of one
            grouped call after the whole backward pass. Eagerly it changes nothing.

    Returns:
        The reduced gradients, in order. On a single rank they are the gradients
        themselves: reducing over one rank is the identity, and skipping the
        engine there (as Horovod does) keeps one-process training at full speed.
    """
    out = list(grads)
    if ar.size() == 1:
        return out
    dense, sparse = [], []
    for i, g in enumerate(out):
        if g is None:
            continue
        (sparse if isinstance(g, tf.IndexedSlices) and not sparse_as_dense else dense).append(i)
    if dense:
        xs = [tf.convert_to_tensor(out[i]) for i in dense]
        if overlap and not tf.executing_eagerly():
            ys = reduce_overlapped(xs, [names[i] for i in dense], op, compression, comm_hook)
        else:
            ys = grouped_dense(xs, op, compression, [names[i] for i in dense], comm_hook)
        for i, y in zip(dense, ys):
            out[i] = y
    # The sparse ones after the dense ones: inside a tf.function TF runs stateful ops in program
    # order, so an allgather made first would hold the dense buckets' submits until the whole
    # backward pass (an embedding's gradient is its last op) and defeat the overlap.
    for i in sparse:
        out[i] = allreduce(out[i], op=op, name=names[i])
    return out
