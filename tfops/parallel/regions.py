"""The region operators of tensor parallelism: where activations enter and leave a tensor group.

Megatron-LM (``megatron/core/tensor_parallel/mappings.py``) builds every split layer from these.
Each is one TensorFlow op with its gradient registered beside it (``tf.custom_gradient``), over
the raw collectives of the mesh's ``tensor_set``, so they run eagerly, in ``tf.function`` and in
``model.fit``::

    operator                              forward                      backward
    copy_to_tensor_region       (f)       identity                     allreduce(dy)
    reduce_from_tensor_region   (g)       allreduce(x)                 identity
    scatter_to_tensor_region              my slice of the last axis    allgather(dy) on the last axis
    gather_from_tensor_region             allgather on the last axis   my slice of dy
    gather_from_sequence_region           allgather on the seq axis    reduce-scatter(dy) on the seq axis
    reduce_scatter_to_sequence_region     reduce-scatter on seq axis   allgather(dy) on the seq axis
    scatter_to_sequence_region            my slice of the seq axis     allgather(dy) on the seq axis

f and g are each other's transpose: a column-parallel layer starts with f (every rank needs the
whole input; each rank's input gradient is only its heads' part, so they are summed) and a
row-parallel layer ends with g (each rank's output is a partial sum). With sequence parallelism
the activations between blocks are split along the sequence: f becomes an allgather, g a
reduce-scatter, the same bytes as the allreduce they replace (an allreduce *is* a reduce-scatter
then an allgather) but LayerNorm and dropout then touch 1/t of the sequence.

Cost (alpha-beta, t ranks, n bytes of the full activation): allreduce 2(t-1)alpha + 2n(t-1)/t beta;
allgather and reduce-scatter (t-1)alpha + n(t-1)/t beta each. A tensor size of 1 runs no collective.

Every collective these run is counted when it runs (not when traced): :func:`collective_counts`,
which the tests and ``allreduce-explain megatron-mlp`` read.
"""
from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

import allreduce as ar

from ..collectives.dispatch import in_step, numpy_call
from ..collectives.process_sets import communicator_of

__all__ = ["copy_to_tensor_region", "reduce_from_tensor_region", "scatter_to_tensor_region",
           "gather_from_tensor_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "scatter_to_sequence_region", "allreduce_max", "allreduce_sum", "collective_counts", "reset_counts",
           "record", "allreduce_sequence_parallel_gradients"]

_COUNTS: collections.Counter = collections.Counter()
_LOG: list | None = None             # when recording: (operator, kind, shape) of each collective as it runs


def collective_counts() -> dict:
    """How many allreduces, allgathers and reduce-scatters the region ops have run on this rank."""
    return dict(_COUNTS)


def reset_counts() -> None:
    _COUNTS.clear()


def record(log: list | None) -> None:
    """Append ``(operator, kind, shape)`` of every collective that runs from now on to ``log`` (``None``: stop)."""
    global _LOG
    _LOG = log


# --------------------------------------------------------------------------- the raw collectives (no gradient)
def _run(kind: str, fn, x, shape, mesh, label: str):
    """``fn(array, comm)`` on this rank's tensor group, inside one numpy_function, counted when it runs."""
    comm = communicator_of(mesh.tensor_set)

    def call(a):
        _COUNTS[kind] += 1
        if _LOG is not None:
            _LOG.append((label, kind, tuple(a.shape)))
        return fn(a, comm)
    y = numpy_call(f"tensor_{kind}", in_step(call, comm), [x], [x.dtype])[0]
    y.set_shape(shape)
    return y


def _allreduce(x, mesh, label, op=ar.Sum):
    return _run("allreduce", lambda a, c: c.allreduce(a, op), x, x.shape, mesh, label)


def _allgather(x, mesh, axis, label):
    shape = x.shape.as_list()
    shape[axis] = None if shape[axis] is None else shape[axis] * mesh.tensor

    def gather(a, comm):                     # the core gathers along axis 0: move ``axis`` there and back
        rows = comm.allgather(np.ascontiguousarray(np.moveaxis(a, axis, 0)))
        return np.ascontiguousarray(np.moveaxis(rows, 0, axis))
    return _run("allgather", gather, x, shape, mesh, label)


def _reduce_scatter(x, mesh, axis, label):
    shape = x.shape.as_list()
    shape[axis] = None if shape[axis] is None else shape[axis] // mesh.tensor

    def scatter(a, comm):
        if a.shape[axis] % comm.size:
            raise ar.InvalidArgumentError(f"reduce_scatter_to_sequence_region: axis {axis} has {a.shape[axis]} "
                                          f"rows, which the tensor size {comm.size} does not divide")
        part = comm.reducescatter(np.moveaxis(a, axis, 0), ar.Sum)
        return np.ascontiguousarray(np.moveaxis(part, 0, axis))
    return _run("reducescatter", scatter, x, shape, mesh, label)


def _my_slice(x, mesh, axis):
    """This tensor rank's equal part of ``axis`` (no communication)."""
    n = x.shape[axis]
    if n is not None and n % mesh.tensor:
        raise ValueError(f"axis {axis} of size {n} does not split into {mesh.tensor} equal parts")
    return tf.split(x, mesh.tensor, axis=axis)[mesh.tensor_rank]


def allreduce_sum(x, mesh, label: str = "sum"):
    """Sum over the tensor group, no gradient (the loss's reductions)."""
    return x if mesh.tensor == 1 else _allreduce(x, mesh, label, ar.Sum)


def allreduce_max(x, mesh, label: str = "max"):
    """Max over the tensor group, no gradient (the loss's stabilising max)."""
    return x if mesh.tensor == 1 else _allreduce(x, mesh, label, ar.Max)


# --------------------------------------------------------------------------- the operators: forward | backward
def copy_to_tensor_region(x, mesh):
    """f: identity forward, allreduce backward (enter a column-parallel layer)."""
    if mesh.tensor == 1:
        return x

    @tf.custom_gradient
    def f(x):
        return tf.identity(x), lambda dy: _allreduce(dy, mesh, "f backward")
    return f(x)


def reduce_from_tensor_region(x, mesh):
    """g: allreduce forward, identity backward (leave a row-parallel layer)."""
    if mesh.tensor == 1:
        return x

    @tf.custom_gradient
    def g(x):
        return _allreduce(x, mesh, "g forward"), lambda dy: tf.identity(dy)
    return g(x)


def scatter_to_tensor_region(x, mesh, axis: int = -1):
    """Split forward (my slice of the last axis), allgather backward."""
    if mesh.tensor == 1:
        return x
    axis = axis % x.shape.rank

    @tf.custom_gradient
    def scatter(x):
        return _my_slice(x, mesh, axis), lambda dy: _allgather(dy, mesh, axis, "scatter backward")
    return scatter(x)


def gather_from_tensor_region(x, mesh, axis: int = -1):
    """Allgather forward (the last axis), split backward."""
    if mesh.tensor == 1:
        return x
    axis = axis % x.shape.rank

    @tf.custom_gradient
    def gather(x):
        return _allgather(x, mesh, axis, "gather forward"), lambda dy: _my_slice(dy, mesh, axis)
    return gather(x)


def gather_from_sequence_region(x, mesh, axis: int = 1):
    """Sequence parallelism's f: allgather forward (the sequence axis), reduce-scatter backward."""
    if mesh.tensor == 1:
        return x

    @tf.custom_gradient
    def gather(x):
        return (_allgather(x, mesh, axis, "sequence f forward"),
                lambda dy: _reduce_scatter(dy, mesh, axis, "sequence f backward"))
    return gather(x)


def reduce_scatter_to_sequence_region(x, mesh, axis: int = 1):
    """Sequence parallelism's g: reduce-scatter forward (the sequence axis), allgather backward."""
    if mesh.tensor == 1:
        return x

    @tf.custom_gradient
    def scatter(x):
        return (_reduce_scatter(x, mesh, axis, "sequence g forward"),
                lambda dy: _allgather(dy, mesh, axis, "sequence g backward"))
    return scatter(x)


def scatter_to_sequence_region(x, mesh, axis: int = 1):
    """Split forward (my part of the sequence), allgather backward (where a replicated input enters
    the sequence-parallel part, e.g. the position embeddings)."""
    if mesh.tensor == 1:
        return x

    @tf.custom_gradient
    def scatter(x):
        return _my_slice(x, mesh, axis), lambda dy: _allgather(dy, mesh, axis, "sequence scatter backward")
    return scatter(x)


def allreduce_sequence_parallel_gradients(grads: list, variables: list, weights: list, mesh) -> list:
    """``grads`` with those of ``weights`` (replicated weights under sequence parallelism: LayerNorms,
    row biases, position embeddings) summed over the tensor group, packed into one allreduce.

    Under sequence parallelism each rank sees only its part of the sequence, so its gradient of a
    replicated weight is a partial sum (Megatron sums them the same way before the optimizer step).
    """
    if mesh.tensor == 1 or not weights:
        return list(grads)
    ids = {id(w) for w in weights}
    at = [i for i, v in enumerate(variables) if id(v) in ids]
    if not at:
        return list(grads)
    flat = tf.concat([tf.reshape(grads[i], [-1]) for i in at], 0)
    total = _allreduce(flat, mesh, "sequence-parallel weight gradients")   # one allreduce for all of them
    out, offset = list(grads), 0
    for i in at:
        n = int(np.prod(grads[i].shape))
        out[i] = tf.reshape(total[offset:offset + n], grads[i].shape)
        offset += n
    return out
