"""The eager fast path of tfops' allreduce and grouped_allreduce: no numpy_function, no tape record.

Run eagerly, ``tf.numpy_function`` is only "call fn on copies of the inputs, then convert its
outputs" (TF 2.21's ``script_ops.py_func_common``), and ``tf.custom_gradient`` adds an identity
op per input and a tape record that nobody reads when no tape is active. For one 4 KiB tensor at
-np 2 those cost ~250 us of a ~540 us call; for 1000 tensors in one group ~0.25 s (cProfile:
an op per tensor at ~30 us, numpy -> tensor conversions with a copy each). So, eagerly and with
no ``GradientTape`` or ``ForwardAccumulator`` recording (:func:`untaped`):

1. inputs: a read-only numpy view of each tensor's own memory (:func:`host_view`; TF tensors
   are immutable, and the engine only reads them);
2. the engine call, as in graph mode (errors typed by :func:`tfops.errors.tf_typed`);
3. outputs: a tensor that keeps the engine's new result array, without a copy (:func:`tensor`;
   ``tf.constant`` copies every numpy array first). TF shares an array's memory only where it
   is 64-byte aligned, as the engine's pooled results (256 KiB and up) are
   (:data:`allreduce.buffers.ALIGN`); a smaller result is copied, which costs little. A group's
   result per dtype is one tensor cut by one ``tf.split`` (:func:`unpack`; ~3 us a piece,
   against ~15 us for a tensor per array).

Under a tape, inside ``tf.function`` and in ``model.fit`` the ops take the graph path
(``numpy_function`` + ``custom_gradient``) as before, so gradients are unchanged.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context, record
from tensorflow.python.framework import ops as tf_ops

__all__ = ["untaped", "host_view", "tensor", "unpack"]


def untaped() -> bool:
    """Eager, and no tape or forward accumulator would record an op now."""
    return tf.executing_eagerly() and not record.could_possibly_record()


def host_view(x: tf.Tensor) -> np.ndarray:
    """``x``'s memory as a read-only numpy array (no copy on the CPU)."""
    a = x._numpy()                                  # noqa: SLF001 - numpy() would copy it
    if not isinstance(a, np.ndarray):               # a 0-d tensor comes back as a numpy scalar
        return np.asarray(a)
    a.flags.writeable = False
    return a


def tensor(a: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """An eager tensor holding ``a`` itself: only for arrays nobody else writes (the engine's new
    results; a pooled one is reused only once no tensor refers to it)."""
    return tf_ops.EagerTensor(a, context.context().device_name, dtype.as_datatype_enum)


def unpack(packed: list, xs: list) -> list:
    """Tensors shaped as ``xs`` from ``GroupedHandle.wait_packed()``'s ``(positions, flat result,
    bounds)`` per dtype."""
    ys: list = [None] * len(xs)
    for members, joint, bounds in packed:
        dtype = xs[members[0]].dtype
        if len(members) > 1 and all(xs[i].shape.rank == 1 for i in members):
            pieces = tf.split(tensor(joint, dtype), [bounds[k + 1] - bounds[k] for k in range(len(members))])
            for i, piece in zip(members, pieces):
                ys[i] = piece
        else:                                        # a reshape op costs more than a tensor per array
            for k, i in enumerate(members):
                ys[i] = tensor(joint[bounds[k]:bounds[k + 1]].reshape(xs[i].shape), dtype)
    return ys
