"""One step's gradients, reduced together: shared by the tape, the optimizer and the hooks.

Dense gradients go to the engine in one grouped call (the engine fuses
them); ``IndexedSlices`` (embedding gradients) are allgathered, values and
indices, or densified first with ``sparse_as_dense=True``. Names are
positions, the same on every rank.
"""
from __future__ import annotations

import tensorflow as tf

import allreduce as ar

from ..collectives.compression import Compression, check_compression
from ..collectives.dispatch import Average, check_op, plain_python
from ..collectives.ops import grouped_dense, allreduce
from .overlap import reduce_overlapped

__all__ = ["gradient_names", "reduce_gradients"]


def gradient_names(prefix: str, count: int) -> list[str]:
    """Cross-rank names for one step's gradients: by position, as Horovod names them.

    Positions, not variable names: Keras numbers layers per process (``dense_3``), so a rank
    that built one more model would otherwise never match its peers. A different variable set
    on one rank shows up as a shape ``MismatchError`` or, for extra variables, a stall.
    """
    return [f"{prefix}.grad.{i}" for i in range(count)]


@plain_python
def reduce_gradients(grads, names: list[str], op=Average, compression=Compression.none,
                     sparse_as_dense: bool = False, overlap: bool = False, comm_hook=None) -> list:
    """Reduce a step's gradients: every dense one in ONE grouped call, sparse ones allgathered.

    Args:
        grads: tensors, ``tf.IndexedSlices`` or ``None`` (kept as ``None``).
        names: one cross-rank name per gradient (:func:`gradient_names`).
        op: ``Sum`` or ``Average``.
        compression: applied to the dense gradients.
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
    dense = []
    for i, g in enumerate(out):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) and not sparse_as_dense:
            out[i] = allreduce(g, op=op, name=names[i])
        else:
            dense.append(i)
    if dense:
        xs = [tf.convert_to_tensor(out[i]) for i in dense]
        if overlap and not tf.executing_eagerly():
            ys = reduce_overlapped(xs, [names[i] for i in dense], check_op(op), check_compression(compression),
                                   comm_hook)
        else:
            ys = grouped_dense(xs, check_op(op), check_compression(compression), [names[i] for i in dense],
                                comm_hook)
        for i, y in zip(dense, ys):
            out[i] = y
    return out
