"""Horovod's arguments on the reduction ops: ``op``/``average``, scale factors, sparse limits.

``op`` and the deprecated ``average`` follow Horovod's rule: ``op`` wins;
``average=True`` means Average and ``average=False`` Sum (with a
``DeprecationWarning``); neither means Average; both is a ``ValueError``.

``prescale_factor`` multiplies every rank's tensor before the reduction and
``postscale_factor`` the result after it (Average divides by ``size()``
between the two). The product is taken in float64 for integer tensors,
float32 for float16/bfloat16 and the tensor's own dtype otherwise, then cast
back (``tf.cast``: truncation toward zero for integers), as Horovod's CPU ops
do. A factor of 1 adds no op. Gradients flow through the scaling.
"""
from __future__ import annotations

import warnings

import tensorflow as tf

import allreduce as ar

__all__ = ["op_from", "scale", "check_sparse"]


def op_from(op, average):
    """The reduction op for Horovod's ``op=`` and deprecated ``average=`` (``None``: not given)."""
    if isinstance(average, ar.Op):           # allreduce(t, tfops.Sum): Horovod's 2nd argument is average
        raise TypeError(f"average must be True or False, got {average!r}: pass the reduction as op={average!r}")
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` (Horovod 0.19)", DeprecationWarning,
                      stacklevel=3)
        return ar.Average if average else ar.Sum
    return ar.Average


def _compute_dtype(dtype: tf.DType) -> tf.DType:
    if dtype.is_integer:
        return tf.float64
    if dtype in (tf.float16, tf.bfloat16):
        return tf.float32
    return dtype


def scale(x: tf.Tensor, factor, what: str) -> tf.Tensor:
    """``x * factor`` in ``x``'s dtype, computed as Horovod's CPU ops do; ``x`` itself for 1."""
    if isinstance(factor, (int, float)) and factor == 1.0:
        return x
    if not (x.dtype.is_floating or x.dtype.is_integer):
        raise ValueError(f"{what} needs a numeric tensor; got {x.dtype.name}")
    compute = _compute_dtype(x.dtype)
    return tf.cast(tf.cast(x, compute) * tf.cast(factor, compute), x.dtype)


def check_sparse(op, prescale_factor, postscale_factor) -> None:
    """``tf.IndexedSlices`` are allgathered, so only Sum and Average apply, unscaled (Horovod's rule)."""
    if op not in (ar.Sum, ar.Average):
        raise NotImplementedError(f"Only Sum and Average ops are supported with tf.IndexedSlices, not {op!r} "
                                  "(pass sparse_as_dense=True, or convert with tf.convert_to_tensor)")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
