"""Process sets in TensorFlow: ``process_set=`` on tfops' collectives (Horovod's API).

::

    evens = tfops.add_process_set([0, 2])        # every rank calls it, in the same order
    if evens.included():
        y = tfops.allreduce(x, process_set=evens)   # averaged over ranks 0 and 2

The sets themselves live in the core (:mod:`allreduce.process_sets`: one
MPI sub-communicator each). Here is what TensorFlow adds: the set versions
of ``allreduce``, ``grouped_allreduce``, ``allgather`` and ``broadcast``, and
:func:`with_process_set`, which gives the world versions in :mod:`tfops.collectives.ops`
their ``process_set=`` argument (the global set, the default, runs the world
op unchanged). A set's ops run on its communicator's direct path, inside one
``tf.numpy_function`` each; their gradients run over the same set.

==================  ===============================  ==============================================
op on a set         forward                          gradient (loss = sum of the members' losses)
==================  ===============================  ==============================================
allreduce Sum/Avg   post * reduce(pre * x)           the same allreduce of dy, same scales
allreduce Min/Max   reduce(x)                        allreduce(dy, Sum) where x == y, else 0
allreduce Product   post * prod(pre * x)             allreduce(dy, Sum) * y / x
allgather           members' rows, in set order      allreduce(dy, Average), my rows (Horovod's)
broadcast           root's x (root: a world rank)    allreduce(dy, Average) on root, 0 elsewhere
==================  ===============================  ==============================================

A rank outside the set that calls one of its ops gets ``InvalidArgumentError``
(a ``ValueError``) at once, as in Horovod. ``compression=`` is accepted and
not applied on a set (the direct path sends the tensor's own dtype).
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
import tensorflow as tf

import allreduce as ar
from allreduce.process_sets import (ProcessSet, add_process_set, global_process_set, process_set_by_id,
                                    remove_process_set)

from .arguments import scale
from .dispatch import in_step, numpy_call, plain_python

__all__ = ["ProcessSet", "add_process_set", "remove_process_set", "global_process_set", "process_set_by_id",
           "process_set_included_op", "NotInProcessSetError", "communicator_of", "is_global",
           "with_process_set", "gather_grad", "gather_raw"]

_OPS = {ar.Sum, ar.Average, ar.Min, ar.Max, ar.Product}


def is_global(process_set) -> bool:
    """``None`` or the global set (id 0): the world's ops apply."""
    return process_set is None or process_set is global_process_set or process_set.process_set_id == 0


class NotInProcessSetError(ar.InvalidArgumentError, tf.errors.InvalidArgumentError):
    """A rank called a collective of a process set it is not in (Horovod raises
    ``tf.errors.InvalidArgumentError`` there; this is also a ``ValueError``)."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def communicator_of(process_set):
    """The communicator a collective on ``process_set`` runs on.

    Raises :class:`NotInProcessSetError` on a rank outside the set, and
    ``allreduce.InvalidArgumentError`` (a ``ValueError``) for a set not registered.
    """
    if is_global(process_set):
        return ar.communicator()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a tfops.ProcessSet, got {type(process_set).__name__}")
    if process_set.included() is False:
        raise NotInProcessSetError(f"rank {ar.rank()} is not in {process_set}: only its members may call its "
                                   "collectives (check ps.included() first)")
    return process_set.communicator


def process_set_included_op(process_set_id: int = 0, name=None):
    """An int32 scalar op, evaluated when it runs: 1 if this rank is in the set with this id, else 0."""
    def run():
        return np.int32(bool(process_set_by_id(int(process_set_id)).included()))
    return tf.reshape(numpy_call("process_set_included", run, [], [tf.int32])[0], [])


def _call(what: str, fn, xs: list, dtypes: list, shapes: list, comm) -> list:
    ys = numpy_call(what, in_step(fn, comm), xs, dtypes)     # fn on ``comm``: in step on the world
    for y, shape in zip(ys, shapes):
        y.set_shape(shape)
    return ys


def _op_of(op, average):
    if average is not None:                     # Horovod's deprecated average=: True is Average, False Sum
        return ar.Average if average else ar.Sum
    op = ar.Average if op is None else op
    if op not in _OPS:
        raise ValueError(f"op must be tfops.Sum, Average, Min, Max or Product on a process set; got {op!r}")
    return ar.Op(op)


# --------------------------------------------------------------------------- allreduce
def _reduce(x, op, pre: float, post: float, ps):
    comm = communicator_of(ps)

    def raw(x):                                 # scaled as the global allreduce is (arguments.scale)
        y = _call("allreduce", lambda a: comm.allreduce(a, op), [scale(x, pre, "prescale_factor")], [x.dtype],
                  [x.shape], comm)[0]
        return scale(y, post, "postscale_factor")
    if not x.dtype.is_floating:
        return raw(x)

    @tf.custom_gradient
    def forward(x):
        y = raw(x)

        def grad(dy):
            if op in (ar.Sum, ar.Average):
                return _reduce(dy, op, pre, post, ps)
            total = _reduce(dy, ar.Sum, 1.0, 1.0, ps)
            if op == ar.Product:
                return total * tf.math.divide_no_nan(y, x)
            return tf.where(tf.equal(x, y), total, tf.zeros_like(total))
        return y, grad
    return forward(x)


@plain_python
def allreduce_in_set(tensor, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None, **_ignored):
    """``allreduce`` on a process set (``tfops.allreduce(..., process_set=ps)`` comes here)."""
    op = _op_of(op, average)
    communicator_of(process_set)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (ar.Sum, ar.Average):
            raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
        values = allgather_in_set(tensor.values, process_set=process_set)
        indices = allgather_in_set(tensor.indices, process_set=process_set)
        if op == ar.Average:
            values = values / tf.cast(process_set.size(), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    return _reduce(tf.convert_to_tensor(tensor), op, prescale_factor, postscale_factor, process_set)


@plain_python
def grouped_allreduce_in_set(tensors, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=None, **_ignored):
    """``grouped_allreduce`` on a process set, fused as the world's is: consecutive dense tensors
    of one floating dtype are laid end to end (up to ``fusion_threshold`` bytes a group, the
    engine's bound) and reduced in ONE allreduce, then cut back into their shapes; a group of one,
    an integer tensor or ``tf.IndexedSlices`` is one call. A pipeline's data axis or a tensor x data
    mesh's ``DistributedOptimizer(process_set=data_set)`` then pays one collective's latency for
    its gradients, not one per weight. Every rank passes the same list, so every rank makes the
    same groups in the same order. The gradient of a fused group is the fused allreduce of the
    upstream gradients (concat and split are differentiable)."""
    kind = _op_of(op, average)
    communicator_of(process_set)
    out: list = [None] * len(tensors)
    limit = _fusion_threshold()
    group: list[tuple[int, tf.Tensor]] = []

    def flush():
        if len(group) == 1:
            i, t = group[0]
            out[i] = _reduce(t, kind, prescale_factor, postscale_factor, process_set)
        elif group:
            flat = tf.concat([tf.reshape(t, [-1]) for _, t in group], 0)
            reduced = _reduce(flat, kind, prescale_factor, postscale_factor, process_set)
            parts = tf.split(reduced, [_count(t) for _, t in group])
            for (i, t), part in zip(group, parts):
                out[i] = tf.reshape(part, tf.shape(t))
        group.clear()

    nbytes = 0
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            flush()
            out[i] = allreduce_in_set(t, op=op, average=average, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, process_set=process_set)
            continue
        t = tf.convert_to_tensor(t)
        size = _count(t) * t.dtype.size if t.shape.is_fully_defined() else None
        if not t.dtype.is_floating or size is None:
            flush()
            out[i] = _reduce(t, kind, prescale_factor, postscale_factor, process_set)
            continue
        if group and (group[0][1].dtype != t.dtype or nbytes + size > limit or not limit):
            flush()
            nbytes = 0
        group.append((i, t))
        nbytes += size
    flush()
    return out


def _count(t) -> int:
    return int(t.shape.num_elements())


def _fusion_threshold() -> int:
    """The running engine's ``fusion_threshold`` (ALLREDUCE_FUSION_THRESHOLD; 0: no fusion)."""
    from allreduce import api
    from allreduce.config import Config
    engine = getattr(api, "_engine", None)
    return int(engine.config.fusion_threshold if engine is not None else Config.from_env().fusion_threshold)


# --------------------------------------------------------------------------- allgather / broadcast
def gather_grad(x, dy, process_set):
    """Horovod's allgather gradient: the members' upstream gradients averaged, this rank's rows kept."""
    comm = communicator_of(process_set)
    total = _call("allgather_grad", lambda g: comm.allreduce(g, ar.Average), [dy], [dy.dtype], [dy.shape],
                  comm)[0]
    rows = _call("allgather_rows", comm.allgather, [tf.shape(x, out_type=tf.int64)[:1]], [tf.int64], [[None]],
                 comm)[0]
    start = tf.reduce_sum(rows[:comm.rank])
    return total[start:start + rows[comm.rank]]


def gather_raw(x, comm):
    """Every member's rows of ``x`` in set order (no gradient)."""
    return _call("allgather", comm.allgather, [x], [x.dtype], [tf.TensorShape([None]).concatenate(x.shape[1:])],
                 comm)[0]


@plain_python
def allgather_in_set(tensor, process_set=None, **_ignored):
    """``allgather`` on a process set."""
    comm = communicator_of(process_set)
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        x = tf.reshape(x, [1])
    if not x.dtype.is_floating:
        return gather_raw(x, comm)

    @tf.custom_gradient
    def forward(x):
        return gather_raw(x, comm), lambda dy: gather_grad(x, tf.convert_to_tensor(dy), process_set)
    return forward(x)


@plain_python
def broadcast_in_set(tensor, root_rank, process_set=None, **_ignored):
    """``broadcast`` on a process set; ``root_rank`` is a world rank inside the set."""
    comm = communicator_of(process_set)
    if root_rank not in process_set.ranks:
        raise ar.InvalidArgumentError(f"broadcast: root_rank {root_rank} is not in {process_set}")
    root = process_set.ranks.index(root_rank)
    x = tf.convert_to_tensor(tensor)

    def raw(x):
        return _call("broadcast", lambda a: comm.broadcast(a, root), [x], [x.dtype], [x.shape], comm)[0]
    if not x.dtype.is_floating:
        return raw(x)

    @tf.custom_gradient
    def forward(x):
        def grad(dy):
            avg = _reduce(tf.convert_to_tensor(dy), ar.Average, 1.0, 1.0, process_set)
            if comm.rank == root:
                return avg
            with tf.control_dependencies([avg]):     # a TF1 graph would prune the allreduce: every rank runs it
                return tf.zeros_like(avg)
        return raw(x), grad
    return forward(x)


def broadcast_object_in_set(obj=None, root_rank: int = 0, name=None, process_set=None):
    """``broadcast_object`` on a process set (Horovod 0.28's ``process_set=``): ``root_rank`` is a
    world rank inside the set, and its ``obj`` reaches the set's other members; eager only."""
    comm = communicator_of(process_set)
    if root_rank not in process_set.ranks:
        raise ar.InvalidArgumentError(f"broadcast_object: root_rank {root_rank} is not in {process_set}")
    return comm.broadcast_object(obj, process_set.ranks.index(root_rank))


def broadcast_object_fn_in_set(root_rank: int = 0, session=None, name=None, process_set=None):
    """``broadcast_object_fn`` on a process set: ``f(obj)`` broadcasts from ``root_rank`` (a world rank in it)."""
    def broadcast_fn(obj=None):
        return broadcast_object_in_set(obj, root_rank, name, process_set=process_set)
    return broadcast_fn


def allgather_object_in_set(obj, name=None, process_set=None) -> list:
    """``allgather_object`` on a process set: the members' objects, in the order of the set's ranks."""
    return communicator_of(process_set).allgather_object(obj)


# --------------------------------------------------------------------------- process_set= on world ops
def with_process_set(world_op, set_op):
    """``world_op`` with a keyword ``process_set=global_process_set``: the global set runs
    ``world_op`` unchanged, another set runs ``set_op`` with every argument by name."""
    signature = inspect.signature(world_op)
    if "process_set" in signature.parameters:   # world_op handles sets itself
        return world_op

    @functools.wraps(world_op)
    def call(*args, process_set=global_process_set, **kwargs):
        if is_global(process_set):
            return world_op(*args, **kwargs)
        named = {k: v for k, v in kwargs.items() if k in signature.parameters}
        bound = signature.bind(*args, **named)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if signature.parameters[k].kind
                     not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
        arguments.update({k: v for k, v in kwargs.items() if k not in named})   # Horovod's other names
        return set_op(process_set=process_set, **arguments)
    extra = inspect.Parameter("process_set", inspect.Parameter.KEYWORD_ONLY, default=global_process_set)
    params = list(signature.parameters.values())
    at = next((i for i, q in enumerate(params) if q.kind == q.VAR_KEYWORD), len(params))
    call.__signature__ = signature.replace(parameters=params[:at] + [extra] + params[at:])
    call.__doc__ = (world_op.__doc__ or "") + "\n    ``process_set=``: run over that set's ranks only " \
        "(:mod:`tfops.collectives.process_sets`); default: every rank.\n"
    return call
