"""Stages 1 and 2's last step: allgather the updated slices into the model's variables, the old
value of a large variable freed before its new one exists.

Every rank holds its piece of every bucket (:mod:`.layout`); the model's variables need all of
them. In the reduce-scatters' bucket order, one bucket after the other's assigns::

    small variables (a bucket of several):   allgather the bucket -> assign each variable
    a large variable W (a bucket of its own): W := [] (validate_shape=False) -> release
                                              -> allgather W's bucket -> W := the result

Why empty W first: an ``assign`` holds the old value until the new one has replaced it, a
transient of the whole model when one variable is most of it (issue 44's 4096 x 4096 MLP at
-np 2: 64 MiB on top of 119 at the step's peak). Assigning an empty tensor drops the variable's
reference; TensorFlow frees the buffer unless another tensor still shares it (a user's
``tf.identity`` snapshot keeps its bits: nothing is written in place). Between the two assigns
nothing reads W: every op of the step that reads it comes before (the allgather waits for the
update, which waits for every gradient), and later reads of the same variable come after its
last assign (a ``tf.function`` orders ops on one resource as written). (Writing blocks in place
with ``ResourceStridedSliceAssign`` was tried: it puts the variable in copy-on-read mode, so
every later read copied the whole weight, 80 MiB more at the peak.)

The py_func calls named ``release`` make TensorFlow drop numpy arrays whose tensors died:
TensorFlow decrefs them at the end of the next py_func call, so without them (1) the gradient
slice (the reduce-scatters' numpy arrays) lived into the first allgather, (2) an emptied
variable's old value, itself a previous allgather's array, lived through its own allgather, and
(3) the step's last results lived into the next step's backprop. The values are copies, so
the weights are the same bits as one assign of the gathered bucket.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..collectives.dispatch import listed
from ..errors import tf_typed
from .exchange import allgather_bucket
from .layout import Shard

__all__ = ["REPLACE_BYTES", "gather_into_model"]

REPLACE_BYTES = 1 << 20
"""A variable of this many bytes or more (a bucket of its own) is emptied before its allgather,
so its old and new values never coexist; smaller buckets are assigned as they come."""


def _release() -> np.int32:
    """A py_func call: TF drops the numpy arrays whose tensors died since the last one."""
    return np.int32(0)


def _release_after(deps: list) -> tf.Tensor:
    """A ``release`` py_func call that runs once ``deps`` (None entries: eager assigns) have."""
    with tf.control_dependencies([d for d in deps if d is not None]):
        return tf.numpy_function(_release, [], tf.int32, stateful=True, name="tfops_shard_release")


def _assign(variable, value):
    """Assign ``value`` to the Keras ``variable``; the assign op in a graph (None eagerly).
    ``keras.Variable.assign`` returns ``value`` itself, so a control dependency on its result
    waits for the value, not for the assign (issue 44: the release ran before it)."""
    return tf.raw_ops.AssignVariableOp(resource=variable.handle, value=tf.cast(value, variable.dtype))


def _gather_replacing(variable, part: tf.Tensor, shard: Shard, bucket, after: list, comm) -> list:
    """A one-variable bucket: empty ``variable`` (its old value freed, unless another tensor
    still holds it), flush TF's delayed numpy decrefs, allgather, assign. Returns the assign."""
    dtype = tf.as_dtype(variable.dtype)
    with tf.control_dependencies([a for a in after if a is not None]):   # a shape unknown to the graph: an
        empty = tf.numpy_function(lambda: np.zeros([0] * len(variable.shape), dtype.as_numpy_dtype), [], dtype,
                                  stateful=True, name="tfops_shard_empty")   # empty constant fails its check
        emptied = tf.raw_ops.AssignVariableOp(resource=variable.handle, value=empty, validate_shape=False)
    with tf.control_dependencies([_release_after([emptied])]):
        full = tf.numpy_function(tf_typed(lambda a: allgather_bucket(a, shard, bucket, comm=comm)[0]), [part],
                                 tf.as_dtype(shard.dtype), stateful=True, name="tfops_shard_ag")
    return [_assign(variable, tf.reshape(full, variable.shape))]


def gather_into_model(shards: list[Shard], segments, seg_vars, model_vars, *, comm) -> None:
    """Allgather every bucket's updated pieces (this rank's: ``seg_vars``) into ``model_vars``,
    in the reduce-scatters' bucket order (see the module docstring)."""
    pieces = [[[tf.convert_to_tensor(sv) for s, sv in zip(segments, seg_vars) if s.var in bk.vars]
               for bk in sh.buckets] for sh in shards]   # read after the inner optimizer's update
    after = [_release_after([t for per_shard in pieces for mine in per_shard for t in mine])]
    for sh, per_shard in zip(shards, pieces):
        for bk, mine in zip(sh.buckets, per_shard):
            part = mine[0] if len(mine) == 1 else tf.concat(mine, 0)   # this rank's piece (one segment: no copy)
            if len(bk.vars) == 1 and (bk.stop - bk.start) * np.dtype(sh.dtype).itemsize >= REPLACE_BYTES:
                after = _gather_replacing(model_vars[bk.vars[0]], part, sh, bk, after, comm)
                continue
            with tf.control_dependencies([a for a in after if a is not None]):
                fulls = tf.numpy_function(tf_typed(lambda a, sh=sh, bk=bk: allgather_bucket(a, sh, bk, comm=comm)),
                                          [part], [tf.as_dtype(sh.dtype)] * len(bk.vars), stateful=True,
                                          name="tfops_shard_ag")
            after = [_assign(model_vars[v], tf.reshape(full, model_vars[v].shape))
                     for v, full in zip(bk.vars, listed(fulls))]
    _release_after(after)
