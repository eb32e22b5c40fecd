"""The one way from a TensorFlow op down to the engine: every collective in tfops/collectives/ calls it.

::

    tfops.allreduce / allgather / broadcast / alltoall / ...  (ops.py, gather.py, scatter.py, process_sets.py)
        │  eagerly: numpy arrays straight in (eager.py)
        │  in a graph: numpy_call(what, fn, ...) -> one tf.numpy_function, refused under XLA,
        │              in creation order in TF1 graphs (graph_order.py)
        ▼
    submit / wait / grouped / grouped_packed   ->  ar.allreduce_async, ar.synchronize,
    in_step (the direct path's rendezvous)          ar.grouped_allreduce(_async)   (the engine)

Last, the one primitive both reduction files build on: a dense tensor's allreduce with its
gradient (``allreduce_differentiable``; the gradient table is in :mod:`tfops.collectives.ops`).
``ops.py`` (allreduce) imports ``gather.py`` (its sparse path allgathers), and ``gather.py``
(whose gradients average with an allreduce) imports only this module: the loop the two used to
make (each importing the other, one of them at the bottom of the file) is gone.

Cost: nothing of its own. ``numpy_call`` adds the XLA check (a graph walk, ~us, at trace time only).
"""
from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import allreduce as ar
from allreduce.errors import AllreduceError

from ..errors import tf_typed
from . import eager, graph_order
from .compression import Compression

__all__ = ["Sum", "Average", "Min", "Max", "Product", "Adasum", "submit", "wait", "in_step", "DIRECT", "grouped",
           "listed", "grouped_packed", "XlaNotSupportedError", "plain_python", "check_op", "auto_name", "numpy_call",
           "allreduce_dense", "allreduce_differentiable", "chain", "grouped_dense"]

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
plain_python = tf.autograph.experimental.do_not_convert


def check_op(op):
    """The engine's ``ar.Op`` for ``op``; ``ValueError`` unless it is one of tfops' six ops."""
    if op not in _OPS:
        raise ValueError(f"op must be tfops.Sum, Average, Min, Max, Product or Adasum; got {op!r}")
    return ar.Op(op)


def auto_name(kind: str, name: str | None) -> str:
    # A counter is the same on every rank as long as every rank calls (or traces) the ops in
    # the same order, as Horovod's eager auto-names are.
    return f"tfops.{kind}.{next(_names)}" if name is None else str(name)


def numpy_call(what: str, fn, inputs: list, dtypes: list) -> list:
    """``tf.numpy_function(fn, inputs, dtypes)``, refused under XLA, where it would crash later."""
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        error = XlaNotSupportedError(
            f"tfops.{what} cannot run inside an XLA-compiled function (jit_compile=True): XLA cannot call "
            "back into Python. Use jit_compile=False (model.compile(..., jit_compile=False) or "
            "tf.function(jit_compile=False)); the tfops.keras callbacks switch it off with a warning.")
        error.ag_pass_through = True       # autograph would re-wrap it as a StagingError
        raise error
    out = graph_order.ordered(      # TF1 graphs: in creation order on every rank (tfops.collectives.graph_order)
        lambda: tf.numpy_function(tf_typed(fn), inputs, dtypes, stateful=True, name=f"tfops_{what}"))
    return listed(out)


def listed(outputs) -> list:
    """``tf.numpy_function``'s outputs as a list (with one output, TF returns it bare)."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


# --------------------------------------------------------------------------- one dense tensor's allreduce and its gradient
def allreduce_dense(x: tf.Tensor, op, compression, name: str) -> tf.Tensor:
    """``x`` allreduced under ``name``, no gradient: eagerly straight into the engine, in a graph one
    ``numpy_call``."""
    if tf.executing_eagerly():                # tfops.collectives.eager: no numpy_function, no copies
        run = tf_typed(lambda a: wait(submit(a, name, op, compression)))
        return eager.tensor(run(eager.host_view(x)), x.dtype)

    def run(a):
        return wait(submit(a, name, op, compression))
    y = numpy_call("allreduce", run, [x], [x.dtype])[0]
    y.set_shape(x.shape)
    return y


def _allreduce_grad(x, y, dy, op, compression, name):
    if op in (Sum, Average, Adasum):         # Adasum: the upstream gradients' Adasum, as Horovod's
        return allreduce_differentiable(dy, op, compression, name + ".grad")
    return chain(x, y, allreduce_differentiable(dy, Sum, compression, name + ".grad"), op, name)


def chain(x, y, total, op, name: str):
    """Min/Max/Product's gradient from ``total``, the sum of every rank's upstream gradient."""
    if op != Product:
        return tf.where(tf.equal(x, y), total, tf.zeros_like(total))     # Min, Max: the rank(s) that won
    # d(prod_r x_r)/dx_me = the product of the other ranks' x: from the product of the nonzero
    # entries and the count of zeros, so a zero on this rank does not divide by zero.
    zero = tf.equal(x, 0)
    nonzero = tf.where(zero, tf.ones_like(x), x)
    product = allreduce_dense(nonzero, Product, Compression.none, name + ".grad.nonzero")
    zeros = allreduce_dense(tf.cast(zero, tf.int32), Sum, Compression.none, name + ".grad.zeros")
    others = tf.where(zeros - tf.cast(zero, tf.int32) > 0, tf.zeros_like(x), product / nonzero)
    return total * others


def allreduce_differentiable(x, op, compression, name: str):
    """``x`` allreduced under ``name`` (``op`` checked, ``compression`` an engine compressor), with
    the gradient of :mod:`tfops.collectives.ops`'s table when a tape watches a floating ``x``."""
    if not x.dtype.is_floating or eager.untaped():
        return allreduce_dense(x, op, compression, name)

    @tf.custom_gradient
    def forward(x):
        y = allreduce_dense(x, op, compression, name)
        return y, lambda dy: _allreduce_grad(x, y, dy, op, compression, name)
    return forward(x)


# --------------------------------------------------------------------------- many dense tensors in one engine call
_grouped_packed_typed = tf_typed(grouped_packed)     # wrapped once: the eager path calls it every step


def grouped_dense(xs: list, op, compression, names: list[str], comm_hook=None) -> list:
    """Dense tensors ``xs`` allreduced in one engine call (``op`` checked, ``compression`` an engine
    compressor, one cross-rank name each), no gradient: the training path's way in (eagerly one
    packed result per dtype; in a graph one ``numpy_call``)."""
    if tf.executing_eagerly():                # tfops.collectives.eager: one engine call, one tf.split per dtype
        packed = _grouped_packed_typed([eager.host_view(x) for x in xs], names, op, compression, comm_hook)
        return eager.unpack(packed, xs)

    def run(*arrays):
        return grouped(list(arrays), names, op, compression, comm_hook)
    ys = numpy_call("grouped_allreduce", run, xs, [x.dtype for x in xs])
    for x, y in zip(xs, ys):
        y.set_shape(x.shape)
    return ys
