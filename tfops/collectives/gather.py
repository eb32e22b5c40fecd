"""allgather, broadcast and the helpers built on them (Horovod's ``mpi_ops`` and ``functions``).

==================  ===================================  ==============================================
op                  forward                              gradient (for the global loss = sum of rank losses)
==================  ===================================  ==============================================
allgather           concat of x_r along axis 0           allreduce(dy, Average), this rank's rows
broadcast           root's x                             allreduce(dy, Average) on root, 0 elsewhere
==================  ===================================  ==============================================

Both gradients average, as Horovod's ``_allgather_grad`` and
``_broadcast_grad`` do (the mean of the ranks' upstream gradients, not their
sum: at ``-np 2`` with dy = 1 on every rank, the root's gradient is 1).

Broadcasts check every rank's shapes first (one small allgather): a rank
whose tensor has another shape, even with as many elements, fails the call
on every rank with :class:`tfops.errors.MismatchError`.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import allreduce as ar
from allreduce.errors import MismatchError

from .compression import check_compression
from .dispatch import Average, allreduce_differentiable, auto_name, check_op, in_step, numpy_call, plain_python

__all__ = ["allgather", "broadcast", "broadcast_", "broadcast_variables", "broadcast_global_variables",
           "broadcast_object", "broadcast_object_fn", "allgather_object"]


def _mean(dy, name: str) -> tf.Tensor:
    """The ranks' mean of ``dy`` (both gradients below; differentiable, as ``tfops.allreduce`` is)."""
    return allreduce_differentiable(tf.convert_to_tensor(dy), check_op(Average), check_compression(None), name)


# --------------------------------------------------------------------------- allgather
def _allgather_raw(x: tf.Tensor) -> tf.Tensor:
    y = numpy_call("allgather", in_step(ar.allgather), [x], [x.dtype])[0]
    y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
    return y


@plain_python
def allgather(tensor, name: str | None = None, ignore_name_scope: bool = False):
    """Concatenate every rank's ``tensor`` along axis 0 (``hvd.allgather``); rows may differ by rank.

    Ranks whose rows differ in shape (``shape[1:]``), dtype or rank fail on every rank with
    :class:`tfops.errors.MismatchError`. The gradient averages the ranks' upstream gradients
    and keeps this rank's rows (Horovod's). ``ignore_name_scope`` is accepted (names here are
    not scoped).
    """
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        x = tf.reshape(x, [1])
    # The name first, whatever the dtype: ranks whose dtypes differ (an error the core reports on
    # every rank) must still take one name each, or every later automatic name is out of step.
    name = auto_name("allgather", name)
    if not x.dtype.is_floating:
        return _allgather_raw(x)

    @tf.custom_gradient
    def forward(x):
        y = _allgather_raw(x)

        def grad(dy):
            mean = _mean(dy, name + ".grad")
            rows = _allgather_raw(tf.shape(x, out_type=tf.int64)[:1])
            start = tf.reduce_sum(rows[:ar.rank()])
            return mean[start:start + rows[ar.rank()]]
        return y, grad
    return forward(x)


# --------------------------------------------------------------------------- broadcast
def _broadcast_raw(xs: list, root_rank: int) -> list:
    def run(*arrays):
        return _broadcast_arrays(list(arrays), root_rank)
    ys = numpy_call("broadcast", in_step(run), xs, [x.dtype for x in xs])
    for x, y in zip(xs, ys):
        y.set_shape(x.shape)
    return ys


def _check_shapes(arrays: list[np.ndarray], root_rank: int) -> None:
    """Every rank's (shape, dtype) list is root's; else ``MismatchError`` on every rank, naming them."""
    mine = [(a.shape, a.dtype.str) for a in arrays]
    ar.communicator().check_agreement("broadcast")    # out of step: names "broadcast", not this allgather
    every = ar.allgather_object((mine, root_rank))
    if any(other != every[0] for other in every):
        shown = "; ".join(f"rank {r}: root {root}, {[(s, np.dtype(d).name) for s, d in got]}"
                          for r, (got, root) in enumerate(every))
        raise MismatchError(f"broadcast: ranks disagree on the root or on the tensors' shapes/dtypes ({shown}). "
                            "Every rank must broadcast tensors of root's shapes from the same root.")


def _broadcast_arrays(arrays: list[np.ndarray], root_rank: int) -> list[np.ndarray]:
    """Root's arrays on every rank: one shape check, then one broadcast per dtype."""
    if ar.size() > 1:
        _check_shapes(arrays, root_rank)
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


@plain_python
def broadcast(tensor, root_rank: int, name: str | None = None, ignore_name_scope: bool = False):
    """Root's ``tensor`` on every rank (``hvd.broadcast``).

    The gradient is the ranks' upstream gradients averaged, on the root; 0 on the others
    (Horovod's).
    """
    x = tf.convert_to_tensor(tensor)
    name = auto_name("broadcast", name)       # first, whatever the dtype (see allgather)
    if not x.dtype.is_floating:
        return _broadcast_raw([x], root_rank)[0]

    @tf.custom_gradient
    def forward(x):
        y = _broadcast_raw([x], root_rank)[0]

        def grad(dy):
            mean = _mean(dy, name + ".grad")
            if ar.rank() == root_rank:
                return mean
            with tf.control_dependencies([mean]):    # a TF1 graph would prune the allreduce: every rank runs it
                return tf.zeros_like(mean)
        return y, grad
    return forward(x)


# --------------------------------------------------------------------------- variables
@plain_python
def broadcast_variables(variables, root_rank: int = 0, process_set=None):
    """Assign root's values to ``variables`` on every rank, one broadcast per dtype.

    Args:
        variables: ``tf.Variable`` or ``keras.Variable`` objects, the same list on every rank.
        root_rank: the rank whose values win (a world rank; with ``process_set``, one of its ranks,
            e.g. ``mesh.rank_of(data_rank=0)`` to broadcast over a tensor-parallel mesh's data axis).
        process_set: broadcast within this :class:`tfops.ProcessSet` only (default: every rank;
            Horovod's ``process_set=``), one broadcast per variable.

    Returns:
        ``None`` eagerly; inside a ``tf.function``, the op that does the assignments.
    """
    variables = list(variables)
    if not variables:
        return None
    if process_set is not None and process_set.process_set_id != 0:
        from .process_sets import broadcast_in_set
        values = [broadcast_in_set(tf.convert_to_tensor(v), root_rank, process_set=process_set) for v in variables]
    else:
        values = _broadcast_raw([tf.convert_to_tensor(v) for v in variables], root_rank)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*[a for a in assigns if a is not None])


@plain_python
def broadcast_(variables, root_rank: int, name: str | None = None) -> list:
    """In-place broadcast (``hvd.broadcast_``): root's values written into ``variables``.

    Returns:
        The variables' new values (root's), as tensors, in order: eagerly, inside ``tf.function``,
        and in a ``tf.compat.v1`` graph (resource or ref variables), where each returned tensor
        reads its variable after the assignment, so evaluating it in a ``Session`` runs the
        broadcast and leaves root's values in the variable too.
    """
    variables = list(variables)
    if tf.executing_eagerly():
        broadcast_variables(variables, root_rank)
        return [tf.convert_to_tensor(v) for v in variables]
    if not variables:
        return []
    values = _broadcast_raw([tf.convert_to_tensor(v) for v in variables], root_rank)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    with tf.control_dependencies(assigns):       # a graph runs what is fetched: the read needs the assign
        return [tf.identity(v.read_value()) for v in variables]


def broadcast_global_variables(root_rank: int):
    """``hvd.broadcast_global_variables``: TF1 global variables from ``root_rank``.

    TF2 has no global-variable collection outside ``tf.compat.v1`` graphs, so eagerly this
    raises ``RuntimeError`` as Horovod's does: use ``broadcast_variables(model.variables)``.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# --------------------------------------------------------------------------- objects
def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None):
    """Root's picklable ``obj`` on every rank (``hvd.broadcast_object``); eager only."""
    return in_step(ar.broadcast_object)(obj, root_rank=root_rank)


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None):
    """``hvd.broadcast_object_fn``: a function ``f(obj)`` that returns root's ``obj`` on every rank.

    ``session`` (TF1) is accepted and not used: the broadcast runs eagerly.
    """
    def broadcast_fn(obj=None):
        return broadcast_object(obj, root_rank=root_rank, name=name)
    return broadcast_fn


def allgather_object(obj, name: str | None = None) -> list:
    """Every rank's picklable ``obj``, as a list in rank order (``hvd.allgather_object``)."""
    return in_step(ar.allgather_object)(obj)
