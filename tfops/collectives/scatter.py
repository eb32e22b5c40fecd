"""alltoall, reducescatter, grouped_allgather and grouped_reducescatter as TensorFlow ops (Horovod's).

Each is one ``tf.numpy_function`` around the core collective (direct path:
``Communicator.alltoall`` / ``reducescatter`` / ``allgather``) of the world or
of a process set (``process_set=``, :mod:`tfops.collectives.process_sets`), wrapped in
``tf.custom_gradient`` for float tensors, eager, in ``tf.function`` and in
``model.fit``. The gradients are Horovod 0.28's (``horovod/tensorflow/mpi_ops.py``):

=====================  ===========================================  ==========================================
op                     forward                                      gradient
=====================  ===========================================  ==========================================
alltoall               rows ``splits[j]`` to rank j; returns the    alltoall(dy, splits=received splits): each
                       rows received (and, given splits, how many   row's gradient goes back to where the row
                       came from each rank)                         came from
reducescatter Sum      sum over ranks, this rank's share of dim 0   allgather(dy) * size
reducescatter Average  the same / size                              allgather(dy)
grouped_allgather      allgather per tensor, one call               allreduce(dy, Average), my rows (per tensor)
grouped_reducescatter  reducescatter per tensor, one call           as reducescatter, per tensor
=====================  ===========================================  ==========================================

Both reducescatter gradients are also scaled by ``prescale_factor *
postscale_factor``. The forward scaling is allreduce's (``tfops.collectives.arguments.scale``):
float16 and bfloat16 are scaled in float32, integers in float64, as Horovod's
CPU ops do (scaled in float16 itself, a result was off by one float16 ulp).
reducescatter splits dim 0 as Horovod does: the first
``dim0 % size`` ranks get one row more. The Sum gradient's factor ``size``
is Horovod's convention (its optimizers average), not the derivative of
the sum of the ranks' losses, which is ``allgather(dy)``.
"""
from __future__ import annotations

import tensorflow as tf

import allreduce as ar
from allreduce.errors import MismatchError

from .arguments import scale
from .dispatch import in_step, numpy_call, plain_python
from .process_sets import communicator_of, gather_grad, gather_raw, global_process_set

__all__ = ["alltoall", "reducescatter", "grouped_allgather", "grouped_reducescatter"]


def _rows_shape(x) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else tf.TensorShape(None)


# --------------------------------------------------------------------------- alltoall
def _alltoall_raw(x, splits, comm):
    def run(a, s):
        out, received = comm.alltoall(a, s if s.size else None)
        return out, received.astype("int32")
    y, received = numpy_call("alltoall", in_step(run, comm), [x, splits], [x.dtype, tf.int32])
    y.set_shape(_rows_shape(x))
    received.set_shape([comm.size])
    return y, received


@plain_python
def alltoall(tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False,
             process_set=global_process_set):
    """Send rows of ``tensor`` to every rank: ``splits[j]`` rows (first-dimension slices) to rank j.

    Args:
        tensor: a tensor with at least one dimension; its rows go out in order.
        splits: one non-negative integer per rank, summing to ``tensor.shape[0]``; ``None`` (or
            empty) sends ``shape[0] / size`` rows to each rank, which must divide. A bad
            ``splits`` on any rank raises on every rank, naming that rank.
        name, ignore_name_scope: accepted for Horovod's signature (the call is collective by order).
        process_set: run over this set's ranks only (default: every rank).

    Returns:
        The rows received, in rank order; with ``splits`` given, the pair ``(rows,
        received_splits)``, an int32 vector of how many rows came from each rank (Horovod 0.28).
    """
    comm = communicator_of(process_set)
    x = tf.convert_to_tensor(tensor)
    s = tf.constant([], tf.int32) if splits is None else tf.convert_to_tensor(splits)
    if x.dtype.is_floating:
        @tf.custom_gradient
        def forward(x):
            y, received = _alltoall_raw(x, s, comm)

            def grad(dy, _unused):      # the received splits are integers: no gradient
                return alltoall(tf.convert_to_tensor(dy), splits=received, process_set=process_set)[0]
            return (y, received), grad
        y, received = forward(x)
    else:
        y, received = _alltoall_raw(x, s, comm)
    return y if splits is None else (y, received)


# --------------------------------------------------------------------------- reducescatter
def _check_op(op):
    if op not in (ar.Sum, ar.Average):
        raise NotImplementedError(f"reducescatter supports tfops.Sum and tfops.Average, not {op!r}")
    return ar.Op(op)


def _check_shapes(arrays, comm) -> None:
    """Every rank's shapes are the same; else ``MismatchError`` on every rank, naming them. The core
    compares element counts only: (17, 1311) against (17, 23, 57) would pass there (Horovod's
    test_horovod_reducescatter_error)."""
    if comm.size == 1:
        return
    every = comm.allgather_object([tuple(a.shape) for a in arrays])
    if any(shapes != every[0] for shapes in every):
        shown = "; ".join(f"rank {r}: {shapes}" for r, shapes in enumerate(every))
        raise MismatchError(f"reducescatter: tensor shape differs between ranks ({shown}); every rank must pass "
                            "tensors of the same shape")


def _reducescatter_grad(dy, op, scale: float, comm):
    factor = scale * (comm.size if op == ar.Sum else 1)
    dy = tf.convert_to_tensor(dy)
    return gather_raw(dy * tf.cast(factor, dy.dtype) if factor != 1 else dy, comm)


def _grouped_reducescatter(xs: list, op, pre: float, post: float, process_set) -> list:
    comm = communicator_of(process_set)

    def raw(*xs):
        def run(*arrays):
            _check_shapes(arrays, comm)
            return [comm.reducescatter(a, op) for a in arrays]
        scaled = [scale(x, pre, "prescale_factor") for x in xs]
        ys = numpy_call("reducescatter", in_step(run, comm), scaled, [x.dtype for x in xs])
        for x, y in zip(xs, ys):
            y.set_shape(_rows_shape(x))
        return [scale(y, post, "postscale_factor") for y in ys]
    if not all(x.dtype.is_floating for x in xs):
        return raw(*xs)

    @tf.custom_gradient
    def forward(*xs):
        def grad(*dys):
            return [_reducescatter_grad(dy, op, pre * post, comm) for dy in dys]
        return raw(*xs), grad
    return list(forward(*xs))


@plain_python
def reducescatter(tensor, device_dense: str = "", compression=None, op=ar.Average, name: str | None = None,
                  process_set=global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Reduce ``tensor`` over the ranks and keep this rank's share of the first dimension.

    Args:
        tensor: the same shape on every rank, at least one dimension.
        device_dense, compression, name, ignore_name_scope: accepted for Horovod's signature
            (tensors stay on the CPU; no compression on this path).
        op: ``tfops.Sum`` or ``tfops.Average`` (default).
        process_set: run over this set's ranks only (default: every rank).
        prescale_factor, postscale_factor: multiply before / after the reduction.

    Returns:
        Rows ``[start_r, start_r + n_r)`` of the reduction, where the first ``dim0 % size`` ranks
        get ``dim0 // size + 1`` rows and the others ``dim0 // size``.
    """
    return _grouped_reducescatter([tf.convert_to_tensor(tensor)], _check_op(op), prescale_factor,
                                  postscale_factor, process_set)[0]


@plain_python
def grouped_reducescatter(tensors, device_dense: str = "", compression=None, op=ar.Average,
                          process_set=global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None):
    """:func:`reducescatter` of every tensor in ``tensors``, in one op; returns the list of shares."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return _grouped_reducescatter(tensors, _check_op(op), prescale_factor, postscale_factor, process_set)


# --------------------------------------------------------------------------- grouped_allgather
@plain_python
def grouped_allgather(tensors, name: str | None = None, ignore_name_scope: bool = False,
                      process_set=global_process_set):
    """Allgather every tensor in ``tensors`` (rows may differ by rank), in one op.

    The gradient of each is Horovod's allgather gradient: the ranks' upstream gradients
    averaged, this rank's rows kept.
    """
    comm = communicator_of(process_set)
    xs = [tf.convert_to_tensor(t) for t in tensors]
    xs = [tf.reshape(x, [1]) if x.shape.rank == 0 else x for x in xs]
    if not xs:
        return []

    def raw(*xs):
        ys = numpy_call("grouped_allgather", in_step(lambda *arrays: [comm.allgather(a) for a in arrays], comm),
                         list(xs), [x.dtype for x in xs])
        for x, y in zip(xs, ys):
            y.set_shape(_rows_shape(x))
        return ys
    if not all(x.dtype.is_floating for x in xs):
        return raw(*xs)

    @tf.custom_gradient
    def forward(*xs):
        def grad(*dys):
            return [gather_grad(x, tf.convert_to_tensor(dy), process_set) for x, dy in zip(xs, dys)]
        return raw(*xs), grad
    return list(forward(*xs))
