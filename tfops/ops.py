"""TensorFlow ops over the engine, each with its gradient, in eager mode and inside ``tf.function``.

Every op is one ``tf.numpy_function`` that hands numpy arrays to the
allreduce engine, wrapped in ``tf.custom_gradient``. The three functions
under "the engine" below are the only place tfops calls the engine's
reduction API (``ar.allreduce_async`` / ``ar.synchronize``): named tensors,
negotiated across ranks (any submission order), fused and compressed in the
engine's background thread, which also writes ``ALLREDUCE_TIMELINE``.

==================  =============================  ====================================================
op                  forward                        gradient (for the global loss = sum of rank losses)
==================  =============================  ====================================================
allreduce Sum/Avg   y = sum (or mean) of x_r       allreduce(dy) with the same op
allreduce Min/Max   y = min/max of x_r             allreduce(dy, Sum) where x == y, else 0 (ties share)
grouped_allreduce   one call for many tensors      grouped_allreduce(dys), same op
allgather           concat of x_r along axis 0     allreduce(dy, Sum), this rank's rows (reducescatter)
broadcast           root's x                       allreduce(dy, Sum) on root, 0 elsewhere (reduce to root)
==================  =============================  ====================================================

The ops are stateful, so inside a ``tf.function`` TF runs them in program
order on every rank. XLA cannot call back into Python: an op traced inside a
``jit_compile=True`` function raises :class:`XlaNotSupportedError` at trace
time rather than failing deep inside the XLA compiler.
"""
from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import allreduce as ar
from allreduce.errors import AllreduceError

from allreduce.engine.compression import check_compressor as check_compression

Compression = ar.Compression

__all__ = ["submit", "wait", "grouped", "Sum", "Average", "Min", "Max", "Compression", "XlaNotSupportedError",
           "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_object",
           "allgather_object"]

Sum, Average, Min, Max = ar.Sum, ar.Average, ar.Min, ar.Max
_OPS = (Sum, Average, Min, Max)
_names = itertools.count()


# --------------------------------------------------------------------------- the engine
def submit(x: np.ndarray, name: str, op, compression):
    """Start the allreduce of ``x`` under ``name`` in the engine; return its handle at once."""
    return ar.allreduce_async(x, name=name, op=op, compression=compression)


def wait(handle) -> np.ndarray:
    """Block until ``handle`` is done; return the reduced array (or raise the engine's error)."""
    return ar.synchronize(handle)


def grouped(arrays: list, names: list[str], op, compression) -> list:
    """Allreduce the arrays as one engine tensor per dtype (``ar.grouped_allreduce``), named after
    the first: one submit, one negotiation bit and one allreduce per step instead of one per
    gradient. A rank with other shapes (a different variable set) fails with ``MismatchError``
    on every rank."""
    return ar.grouped_allreduce(arrays, name=f"{names[0]}+group", op=op, compression=compression)


# --------------------------------------------------------------------------- TF plumbing
class XlaNotSupportedError(AllreduceError, ValueError):
    """A tfops op was traced inside an XLA-compiled (``jit_compile=True``) function."""


# The public ops are plain Python around one numpy_function each: autograph has nothing to
# convert in them, and converting them would also convert the callbacks they define.
_plain_python = tf.autograph.experimental.do_not_convert


def _check_op(op):
    if op not in _OPS:
        raise ValueError(f"op must be tfops.Sum, Average, Min or Max; got {op!r}")
    return ar.Op(op)


def _name(kind: str, name: str | None) -> str:
    # A counter is the same on every rank as long as every rank calls (or traces) the ops in
    # the same order, as Horovod's eager auto-names are.
    return f"tfops.{kind}.{next(_names)}" if name is None else str(name)


def _numpy_call(what: str, fn, inputs: list, dtypes: list) -> list:
    """``tf.numpy_function(fn, inputs, dtypes)``, refused under XLA, where it would crash later."""
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        error = XlaNotSupportedError(
            f"tfops.{what} cannot run inside an XLA-compiled function (jit_compile=True): XLA cannot call "
            "back into Python. Use jit_compile=False (model.compile(..., jit_compile=False) or "
            "tf.function(jit_compile=False)); the tfops.keras callbacks switch it off with a warning.")
        error.ag_pass_through = True       # autograph would re-wrap it as a StagingError
        raise error
    out = tf.numpy_function(fn, inputs, dtypes, stateful=True, name=f"tfops_{what}")
    return list(out) if isinstance(out, (list, tuple)) else [out]


# --------------------------------------------------------------------------- allreduce
def _allreduce_dense(x: tf.Tensor, op, compression, name: str) -> tf.Tensor:
    def run(a):
        return wait(submit(a, name, op, compression))
    y = _numpy_call("allreduce", run, [x], [x.dtype])[0]
    y.set_shape(x.shape)
    return y


def _allreduce_grad(x, y, dy, op, compression, name):
    if op in (Sum, Average):
        return _allreduce_differentiable(dy, op, compression, name + ".grad")
    total = _allreduce_differentiable(dy, Sum, compression, name + ".grad")
    return tf.where(tf.equal(x, y), total, tf.zeros_like(total))


def _allreduce_differentiable(x, op, compression, name):
    if not x.dtype.is_floating:
        return _allreduce_dense(x, op, compression, name)

    @tf.custom_gradient
    def forward(x):
        y = _allreduce_dense(x, op, compression, name)
        return y, lambda dy: _allreduce_grad(x, y, dy, op, compression, name)
    return forward(x)


@_plain_python
def allreduce(tensor, op=Average, compression=Compression.none, name: str | None = None):
    """Reduce ``tensor`` over all ranks (Horovod's ``hvd.allreduce``).

    Args:
        tensor: a ``tf.Tensor``, variable, array or ``tf.IndexedSlices``. Slices are
            allgathered (values and indices) instead of reduced, as in Horovod.
        op: ``tfops.Sum``, ``Average`` (default), ``Min`` or ``Max``.
        compression: ``tfops.Compression.none`` (default), ``fp16`` or ``bf16``.
        name: the name every rank uses for this tensor; default: an automatic
            name that matches across ranks calling the ops in the same order.

    Returns:
        A tensor of the same shape and dtype, identical on every rank.
    """
    op = _check_op(op)
    compression = check_compression(compression)
    name = _name("allreduce", name)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Sum, Average):
            raise ValueError(f"sparse (IndexedSlices) allreduce supports Sum and Average, not {op!r}")
        values = allgather(tensor.values, name=name + ".values")
        indices = allgather(tensor.indices, name=name + ".indices")
        if op == Average:
            values = values / tf.cast(ar.size(), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    return _allreduce_differentiable(tf.convert_to_tensor(tensor), op, compression, name)


def _grouped_dense(xs: list, op, compression, names: list[str]) -> list:
    def run(*arrays):
        return grouped(list(arrays), names, op, compression)
    ys = _numpy_call("grouped_allreduce", run, xs, [x.dtype for x in xs])
    for x, y in zip(xs, ys):
        y.set_shape(x.shape)
    return ys


@_plain_python
def grouped_allreduce(tensors, op=Average, compression=Compression.none, name: str | None = None) -> list:
    """Allreduce a list of dense tensors in one engine call (``hvd.grouped_allreduce``).

    Args:
        tensors: dense tensors of any shapes and dtypes.
        op: ``Sum`` or ``Average`` (default); the gradient is the same grouped call.
        compression: ``Compression.none``, ``fp16`` or ``bf16``.
        name: the group's name; tensor i is named ``name.i``.

    Returns:
        The reduced tensors, in order.
    """
    op = _check_op(op)
    if op not in (Sum, Average):
        raise ValueError(f"grouped_allreduce supports Sum and Average, not {op!r}; use allreduce per tensor")
    compression = check_compression(compression)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    base = _name("grouped", name)
    names = [f"{base}.{i}" for i in range(len(tensors))]
    if not all(t.dtype.is_floating for t in tensors):
        return _grouped_dense(tensors, op, compression, names)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_dense(list(xs), op, compression, names)

        def grad(*dys):
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            return grouped_allreduce(dys, op=op, compression=compression, name=base + ".grad")
        return ys, grad
    return list(forward(*tensors))


# --------------------------------------------------------------------------- allgather / broadcast
def _allgather_raw(x: tf.Tensor) -> tf.Tensor:
    y = _numpy_call("allgather", ar.allgather, [x], [x.dtype])[0]
    y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
    return y


@_plain_python
def allgather(tensor, name: str | None = None):
    """Concatenate every rank's ``tensor`` along axis 0 (``hvd.allgather``); rows may differ by rank.

    The gradient sums the upstream gradients of all ranks and keeps this rank's rows.
    """
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        x = tf.reshape(x, [1])
    if not x.dtype.is_floating:
        return _allgather_raw(x)
    name = _name("allgather", name)

    @tf.custom_gradient
    def forward(x):
        y = _allgather_raw(x)

        def grad(dy):
            total = allreduce(tf.convert_to_tensor(dy), op=Sum, name=name + ".grad")
            rows = _allgather_raw(tf.shape(x, out_type=tf.int64)[:1])
            start = tf.reduce_sum(rows[:ar.rank()])
            return total[start:start + rows[ar.rank()]]
        return y, grad
    return forward(x)


def _broadcast_raw(xs: list, root_rank: int) -> list:
    def run(*arrays):
        return _broadcast_arrays(list(arrays), root_rank)
    ys = _numpy_call("broadcast", run, xs, [x.dtype for x in xs])
    for x, y in zip(xs, ys):
        y.set_shape(x.shape)
    return ys


def _broadcast_arrays(arrays: list[np.ndarray], root_rank: int) -> list[np.ndarray]:
    """Root's arrays on every rank: one broadcast per dtype, however many arrays."""
    out: list = [None] * len(arrays)
    by_dtype: dict[str, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    for members in by_dtype.values():
        flat = ar.broadcast(np.concatenate([arrays[i].reshape(-1) for i in members]), root_rank=root_rank)
        offset = 0
        for i in members:
            out[i] = flat[offset:offset + arrays[i].size].reshape(arrays[i].shape)
            offset += arrays[i].size
    return out


@_plain_python
def broadcast(tensor, root_rank: int, name: str | None = None):
    """Root's ``tensor`` on every rank (``hvd.broadcast``). The gradient is a reduce to the root."""
    x = tf.convert_to_tensor(tensor)
    if not x.dtype.is_floating:
        return _broadcast_raw([x], root_rank)[0]
    name = _name("broadcast", name)

    @tf.custom_gradient
    def forward(x):
        y = _broadcast_raw([x], root_rank)[0]

        def grad(dy):
            total = allreduce(tf.convert_to_tensor(dy), op=Sum, name=name + ".grad")
            return total if ar.rank() == root_rank else tf.zeros_like(total)
        return y, grad
    return forward(x)


@_plain_python
def broadcast_variables(variables, root_rank: int = 0):
    """Assign root's values to ``variables`` on every rank, one broadcast per dtype.

    Args:
        variables: ``tf.Variable`` or ``keras.Variable`` objects, the same list on every rank.
        root_rank: the rank whose values win.

    Returns:
        ``None`` eagerly; inside a ``tf.function``, the op that does the assignments.
    """
    variables = list(variables)
    if not variables:
        return None
    values = _broadcast_raw([tf.convert_to_tensor(v) for v in variables], root_rank)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*[a for a in assigns if a is not None])


def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None):
    """Root's picklable ``obj`` on every rank (``hvd.broadcast_object``); eager only."""
    return ar.broadcast_object(obj, root_rank=root_rank)


def allgather_object(obj, name: str | None = None) -> list:
    """Every rank's picklable ``obj``, as a list in rank order (``hvd.allgather_object``)."""
    return ar.allgather_object(obj)
