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
allreduce Product   y = product of x_r             allreduce(dy, Sum) * (product of the other ranks' x)
grouped_allreduce   one call for many tensors      grouped_allreduce(dys, Sum or the op), then as above
==================  =============================  ====================================================

``prescale_factor``/``postscale_factor`` scale before and after the reduction
(:mod:`tfops.arguments`); the gradient goes through the same scaling.
allgather and broadcast live in :mod:`tfops.gather` (their gradients average,
as Horovod's); they are re-exported here.

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

from . import arguments, eager
from .compression import Compression, check_compression
from .errors import tf_typed
from . import graph_order

__all__ = ["submit", "wait", "in_step", "grouped", "Sum", "Average", "Min", "Max", "Product", "Adasum", "Compression",
           "XlaNotSupportedError", "allreduce", "grouped_allreduce", "allgather", "join", "broadcast",
           "broadcast_variables", "broadcast_object", "allgather_object"]

Sum, Average, Min, Max, Product, Adasum = ar.Sum, ar.Average, ar.Min, ar.Max, ar.Product, ar.Adasum
_OPS = (Sum, Average, Min, Max, Product, Adasum)
_names = itertools.count()


# --------------------------------------------------------------------------- the engine
def submit(x: np.ndarray, name: str, op, compression, comm_hook=None):
    """Start the allreduce of ``x`` under ``name`` in the engine (through ``comm_hook`` when given);
    return its handle at once."""
    return ar.allreduce_async(x, name=name, op=op, compression=compression, comm_hook=comm_hook)


def wait(handle) -> np.ndarray:
    """Block until ``handle`` is done; return the reduced array (or raise the engine's error)."""
    return ar.synchronize(handle)


_EMPTY = np.empty(0, np.uint8)
#: The rendezvous's one name: each rank's k-th direct call meets the others' k-th (a name reused
#: once reduced, as a gradient's is every step); no counter that a failed call could leave apart.
DIRECT = "tfops.direct"


def in_step(fn, comm=None):
    """``fn`` (a collective on the direct path: allgather, broadcast, alltoall, reducescatter),
    after the engine has seen every rank arrive at one: an empty allreduce named :data:`DIRECT`,
    the same name on every rank whatever the collective.

    Horovod sends every op through its background thread by name, so a rank that failed a step
    and went on to another op (an allreduce on one rank, an allgather on another) is found out of
    step. The direct path has no names: there the two ranks would wait on each other until the
    transport timeout (30 s). The rendezvous puts the direct call's name where the engine's
    out-of-step inspector sees it: every rank fails within ``out_of_step_time`` seconds with a
    ``StallError`` naming who waits for what (and ranks in step meet at once). Different
    direct-path collectives on different ranks pass it and fail in the collectives' own metadata
    check, naming each rank's collective. Only on the world communicator (a process set's
    collective involves only its ranks); ``out_of_step_time`` 0 turns it off, and with it the
    ~0.1 ms the engine's round trip costs."""
    if comm is not None and comm is not ar.communicator():
        return fn

    def run(*args, **kwargs):
        if ar.size() > 1 and ar.communicator().config.out_of_step_time > 0:
            wait(submit(_EMPTY, DIRECT, Sum, None))
        return fn(*args, **kwargs)
    return run


def grouped(arrays: list, names: list[str], op, compression, comm_hook=None) -> list:
    """Allreduce the arrays as one engine tensor per dtype (``ar.grouped_allreduce``), named after
    the first: one submit, one negotiation bit and one allreduce per step instead of one per
    gradient. A rank with other shapes (a different variable set) fails with ``MismatchError``
    on every rank. A ``comm_hook`` (``ar.PowerSGD``, ``ar.OneBit``) reduces the group as one bucket."""
    return ar.grouped_allreduce(arrays, name=f"{names[0]}+group", op=op, compression=compression,
                                comm_hook=comm_hook)


def grouped_packed(arrays: list, names: list[str], op, compression, comm_hook=None) -> list:
    """:func:`grouped` with the results packed: per dtype ``(positions, flat result, bounds)``
    (``GroupedHandle.wait_packed``), for eager callers that cut them up with one TF op."""
    return ar.grouped_allreduce_async(arrays, name=f"{names[0]}+group", op=op, compression=compression,
                                      comm_hook=comm_hook).wait_packed()


# --------------------------------------------------------------------------- TF plumbing
class XlaNotSupportedError(AllreduceError, ValueError):
    """A tfops op was traced inside an XLA-compiled (``jit_compile=True``) function."""


# The public ops are plain Python around one numpy_function each: autograph has nothing to
# convert in them, and converting them would also convert the callbacks they define.
_plain_python = tf.autograph.experimental.do_not_convert


def _check_op(op):
    if op not in _OPS:
        raise ValueError(f"op must be tfops.Sum, Average, Min, Max, Product or Adasum; got {op!r}")
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
    out = graph_order.ordered(      # TF1 graphs: in creation order on every rank (tfops.graph_order)
        lambda: tf.numpy_function(tf_typed(fn), inputs, dtypes, stateful=True, name=f"tfops_{what}"))
    return list(out) if isinstance(out, (list, tuple)) else [out]


# --------------------------------------------------------------------------- allreduce
def _allreduce_dense(x: tf.Tensor, op, compression, name: str) -> tf.Tensor:
    if tf.executing_eagerly():                # tfops.eager: no numpy_function, no copies
        run = tf_typed(lambda a: wait(submit(a, name, op, compression)))
        return eager.tensor(run(eager.host_view(x)), x.dtype)

    def run(a):
        return wait(submit(a, name, op, compression))
    y = _numpy_call("allreduce", run, [x], [x.dtype])[0]
    y.set_shape(x.shape)
    return y


def _allreduce_grad(x, y, dy, op, compression, name):
    if op in (Sum, Average, Adasum):         # Adasum: the upstream gradients' Adasum, as Horovod's
        return _allreduce_differentiable(dy, op, compression, name + ".grad")
    return _chain(x, y, _allreduce_differentiable(dy, Sum, compression, name + ".grad"), op, name)


def _chain(x, y, total, op, name):
    """Min/Max/Product's gradient from ``total``, the sum of every rank's upstream gradient."""
    if op != Product:
        return tf.where(tf.equal(x, y), total, tf.zeros_like(total))     # Min, Max: the rank(s) that won
    # d(prod_r x_r)/dx_me = the product of the other ranks' x: from the product of the nonzero
    # entries and the count of zeros, so a zero on this rank does not divide by zero.
    zero = tf.equal(x, 0)
    nonzero = tf.where(zero, tf.ones_like(x), x)
    product = _allreduce_dense(nonzero, Product, Compression.none, name + ".grad.nonzero")
    zeros = _allreduce_dense(tf.cast(zero, tf.int32), Sum, Compression.none, name + ".grad.zeros")
    others = tf.where(zeros - tf.cast(zero, tf.int32) > 0, tf.zeros_like(x), product / nonzero)
    return total * others


def _allreduce_differentiable(x, op, compression, name):
    if not x.dtype.is_floating or eager.untaped():
        return _allreduce_dense(x, op, compression, name)

    @tf.custom_gradient
    def forward(x):
        y = _allreduce_dense(x, op, compression, name)
        return y, lambda dy: _allreduce_grad(x, y, dy, op, compression, name)
    return forward(x)


def _sparse(tensor: tf.IndexedSlices, op, name: str) -> tf.IndexedSlices:
    """Slices are allgathered, values and indices; Average divides the values by size()."""
    values = allgather(tensor.values, name=name + ".values")
    indices = allgather(tensor.indices, name=name + ".indices")
    if op == Average:
        values = values / tf.cast(ar.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


@_plain_python
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
    op = _check_op(arguments.op_from(op, average))
    compression = check_compression(compression)
    name = _name("allreduce", name)
    if isinstance(tensor, tf.IndexedSlices):
        arguments.check_sparse(op, prescale_factor, postscale_factor)
        return _sparse(tensor, op, name)
    x = arguments.scale(tf.convert_to_tensor(tensor), prescale_factor, "prescale_factor")
    return arguments.scale(_allreduce_differentiable(x, op, compression, name), postscale_factor, "postscale_factor")


def _grouped_dense(xs: list, op, compression, names: list[str], comm_hook=None) -> list:
    if tf.executing_eagerly():                # tfops.eager: one engine call, one tf.split per dtype
        packed = tf_typed(grouped_packed)([eager.host_view(x) for x in xs], names, op, compression, comm_hook)
        return eager.unpack(packed, xs)

    def run(*arrays):
        return grouped(list(arrays), names, op, compression, comm_hook)
    ys = _numpy_call("grouped_allreduce", run, xs, [x.dtype for x in xs])
    for x, y in zip(xs, ys):
        y.set_shape(x.shape)
    return ys


@_plain_python
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
    op = _check_op(arguments.op_from(op, average))
    compression = check_compression(compression)
    tensors = list(tensors)
    if not tensors:
        return []
    base = _name("grouped", name)
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
        return _grouped_dense(xs, op, compression, names)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_dense(list(xs), op, compression, names)

        def grad(*dys):
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            linear = op in (Sum, Average, Adasum)
            totals = grouped_allreduce(dys, op=op if linear else Sum, compression=compression, name=base + ".grad")
            if linear:
                return totals
            return [_chain(x, y, t, op, f"{base}.{i}") for i, (x, y, t) in enumerate(zip(xs, ys, totals))]
        return ys, grad
    return list(forward(*xs))


# --------------------------------------------------------------------------- join
@_plain_python
def join() -> tf.Tensor:
    """Horovod's ``hvd.join()``: this rank has run out of data; block until every rank has joined.

    Meanwhile the other ranks' allreduces go on with zeros in this rank's place, so ``Average``
    divides by the full size, joined ranks included, as Horovod's does (:func:`allreduce.join`).
    Works eagerly and inside ``tf.function``.

    Returns:
        An int32 scalar tensor: the last rank to join.
    """
    return _numpy_call("join", lambda: np.int32(ar.join()), [], [tf.int32])[0]


# --------------------------------------------------------------------------- allgather / broadcast
# In tfops.gather (which imports this module); re-exported for the modules that import them from here.
from .gather import (allgather, allgather_object, broadcast, broadcast_object,  # noqa: E402
                     broadcast_variables)
