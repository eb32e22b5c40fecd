"""allreduce, grouped_allreduce and join: Horovod's reduction ops, eager and inside ``tf.function``.

::

    allreduce(t)          ─ arguments (op, scale) ─┬─ dense:  dispatch.allreduce_differentiable ─┐
    grouped_allreduce(ts) ─ arguments (op, scale) ─┼─ dense:  dispatch.grouped_dense (one call)  ├─> dispatch -> engine
                                                   └─ IndexedSlices: gather.allgather ────────────┘

==================  =============================  ====================================================
op                  forward                        gradient (for the global loss = sum of rank losses)
==================  =============================  ====================================================
allreduce Sum/Avg   y = sum (or mean) of x_r       allreduce(dy) with the same op
allreduce Min/Max   y = min/max of x_r             allreduce(dy, Sum) where x == y, else 0 (ties share)
allreduce Product   y = product of x_r             allreduce(dy, Sum) * (product of the other ranks' x)
grouped_allreduce   one call for many tensors      grouped_allreduce(dys, Sum or the op), then as above
==================  =============================  ====================================================

Every op is one ``tf.numpy_function`` (eagerly: numpy arrays straight in) into the
allreduce engine, wrapped in ``tf.custom_gradient``; how a tensor reaches the engine, and
the one dense tensor's allreduce with its gradient, are in :mod:`tfops.collectives.dispatch`,
which :mod:`tfops.collectives.gather` (allgather, broadcast) uses too.
``prescale_factor``/``postscale_factor`` scale before and after the reduction
(:mod:`tfops.collectives.arguments`); the gradient goes through the same scaling.

The ops are stateful, so inside a ``tf.function`` TF runs them in program
order on every rank. XLA cannot call back into Python: an op traced inside a
``jit_compile=True`` function raises :class:`XlaNotSupportedError` at trace
time rather than failing deep inside the XLA compiler.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import allreduce as ar

from . import arguments, eager
from .compression import Compression, check_compression
from .dispatch import (Adasum, Average, Max, Min, Product, Sum, XlaNotSupportedError,  # noqa: F401
                       allreduce_differentiable, auto_name, chain, check_op, grouped_dense, numpy_call, plain_python)
from .gather import allgather

__all__ = ["Sum", "Average", "Min", "Max", "Product", "Adasum", "Compression", "XlaNotSupportedError",
           "allreduce", "grouped_allreduce", "join"]


def _sparse(tensor: tf.IndexedSlices, op, name: str) -> tf.IndexedSlices:
    """Slices are allgathered, values and indices; Average divides the values by size()."""
    values = allgather(tensor.values, name=name + ".values")
    indices = allgather(tensor.indices, name=name + ".indices")
    if op == Average:
        values = values / tf.cast(ar.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


@plain_python
def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name: str | None = None, ignore_name_scope: bool = False):
    """Reduce ``tensor`` over all ranks (Horovod's ``hvd.allreduce``, same arguments and order).

    Args:
        tensor: a ``tf.Tensor``, variable, array or ``tf.IndexedSlices``. Slices are
            allgathered (values and indices) instead of reduced, as in Horovod; they take
            Sum and Average only, unscaled (else ``NotImplementedError``).
        average: deprecated: ``True`` is ``op=Average``, ``False`` ``op=Sum``; not with ``op``.
        device_dense, device_sparse: accepted for Horovod's scripts; the reduction runs in
            the engine on host memory whatever the device.
        compression: ``tfops.Compression.none`` (default), ``fp16`` or ``bf16``.
        op: ``Sum``, ``Average`` (the default), ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        name: the name every rank uses for this tensor; default: an automatic
            name that matches across ranks calling the ops in the same order.
        ignore_name_scope: accepted (names here are not scoped).

    Returns:
        A tensor of the same shape and dtype, identical on every rank. Ranks that disagree
        on its shape or dtype raise :class:`tfops.errors.MismatchError` (also a
        ``tf.errors.FailedPreconditionError``) on every rank.
    """
    op = check_op(arguments.op_from(op, average))
    compression = check_compression(compression)
    name = auto_name("allreduce", name)
    if isinstance(tensor, tf.IndexedSlices):
        arguments.check_sparse(op, prescale_factor, postscale_factor)
        return _sparse(tensor, op, name)
    x = arguments.scale(tf.convert_to_tensor(tensor), prescale_factor, "prescale_factor")
    return arguments.scale(allreduce_differentiable(x, op, compression, name), postscale_factor, "postscale_factor")


@plain_python
def grouped_allreduce(tensors, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      name: str | None = None, ignore_name_scope: bool = False) -> list:
    """Allreduce a list of tensors in one engine call (``hvd.grouped_allreduce``, same arguments).

    Args:
        tensors: dense tensors of any shapes and dtypes, and ``tf.IndexedSlices`` (allgathered,
            as :func:`allreduce` does; Sum and Average only, unscaled).
        op: ``Sum``, ``Average`` (default), ``Min``, ``Max``, ``Product`` or ``Adasum``;
            ``average``, the scale factors and the device arguments as in :func:`allreduce`.
        compression: ``Compression.none``, ``fp16`` or ``bf16``.
        name: the group's name; tensor i is named ``name.i``.

    Returns:
        The reduced tensors (slices as ``tf.IndexedSlices``), in order. The gradient is one
        grouped call (Sum for Min/Max/Product, then each tensor's rule as in :func:`allreduce`).
    """
    op = check_op(arguments.op_from(op, average))
    compression = check_compression(compression)
    tensors = list(tensors)
    base = auto_name("grouped", name)         # taken on every rank, even with no tensors (see gather.allgather)
    if not tensors:
        return []
    out: list = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        arguments.check_sparse(op, prescale_factor, postscale_factor)
    for i in sparse:
        out[i] = _sparse(tensors[i], op, f"{base}.{i}")
    dense = [i for i in range(len(tensors)) if i not in sparse]
    if dense:
        xs = [arguments.scale(_as_tensor(tensors[i]), prescale_factor, "prescale_factor") for i in dense]
        ys = _grouped_differentiable(xs, op, compression, base, [f"{base}.{i}" for i in dense])
        for i, y in zip(dense, ys):
            out[i] = arguments.scale(y, postscale_factor, "postscale_factor")
    return out


def _as_tensor(t) -> tf.Tensor:
    return t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t)    # 3 us a call even on a tensor


def _grouped_differentiable(xs: list, op, compression, base: str, names: list[str]) -> list:
    if eager.untaped() or not all(t.dtype.is_floating for t in xs):
        return grouped_dense(xs, op, compression, names)

    @tf.custom_gradient
    def forward(*xs):
        ys = grouped_dense(list(xs), op, compression, names)

        def grad(*dys):
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            linear = op in (Sum, Average, Adasum)
            totals = grouped_allreduce(dys, op=op if linear else Sum, compression=compression, name=base + ".grad")
            if linear:
                return totals
            return [chain(x, y, t, op, f"{base}.{i}") for i, (x, y, t) in enumerate(zip(xs, ys, totals))]
        return ys, grad
    return list(forward(*xs))


# --------------------------------------------------------------------------- join
@plain_python
def join() -> tf.Tensor:
    """Horovod's ``hvd.join()``: this rank has run out of data; block until every rank has joined.

    Meanwhile the other ranks' allreduces go on with zeros in this rank's place, so ``Average``
    divides by the full size, joined ranks included, as Horovod's does (:func:`allreduce.join`).
    Works eagerly and inside ``tf.function``.

    Returns:
        An int32 scalar tensor: the last rank to join.
    """
    return numpy_call("join", lambda: np.int32(ar.join()), [], [tf.int32])[0]
