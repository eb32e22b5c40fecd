"""The sharded step's collectives, on numpy arrays: reduce-scatter a bucket, allgather the slices,
sum small vectors of partial norms, and check that every rank shards the same model.

The ring allreduce of lesson 2 is these two halves back to back; ZeRO runs the optimizer step
between them::

    bucket of gradients  --reduce-scatter (Average)-->  my part of the slice     (p-1)/p n bytes sent
    my slice of weights  --allgather-->                 every weight, updated    (p-1)/p n bytes sent

Both halves go over the ring (``allreduce.algorithms.reducescatter``, ``.allgather``) with the
counts of :mod:`.layout` (a bucket's counts are uneven, the slices' equal), so a sharded step sends
what one ring allreduce sends: 2 (p-1)/p n bytes per rank, in (p-1) alpha per bucket plus
(p-1) alpha for the allgather. Each call goes through :func:`tfops.ops.in_step` (the engine's
out-of-step check) and ``Communicator.check_agreement`` (same collective, count and dtype on
every rank, else ``MismatchError`` on every rank).
"""
from __future__ import annotations

import hashlib

import numpy as np
import tensorflow as tf

import allreduce as ar
from allreduce.algorithms.allgather import allgatherv
from allreduce.algorithms.reducescatter import reducescatter as _ring_reducescatter
from allreduce.errors import MismatchError
from allreduce.ops import dtype_code

from ..ops import in_step
from .layout import Bucket, Shard

__all__ = ["reducescatter_bucket", "allgather_slice", "allreduce_sum", "check_same_model"]


def reducescatter_bucket(arrays: list[np.ndarray], shard: Shard, bucket: Bucket, buf: np.ndarray) -> np.ndarray:
    """Average ``arrays`` (the gradients of ``bucket.vars``, ascending) over the ranks; return this
    rank's ``bucket.counts[rank]`` elements. ``buf`` (``stop - start`` elements) is the bucket's
    flat copy, overwritten by the ring."""
    comm = ar.communicator()
    for v, a in zip(bucket.vars, arrays):                # lay the bucket out flat
        k = shard.vars.index(v)
        at = shard.offsets[k] - bucket.start
        buf[at:at + shard.sizes[k]] = a.reshape(-1)
    if bucket.stop > shard.total:                        # the padding is zeros on every rank
        buf[shard.total - bucket.start:] = 0
    out = np.empty(bucket.counts[comm.rank], buf.dtype)

    def run():
        comm.check_agreement("reducescatter", count=buf.size, dtype=dtype_code(buf.dtype), op=int(ar.Average))
        _ring_reducescatter(comm.transport, buf, out, bucket.counts, ar.Average, workspace=comm.workspace)
    in_step(run)()
    return out


def allgather_slice(mine: np.ndarray, shard: Shard) -> np.ndarray:
    """Every rank's ``per_rank`` elements, in rank order: the padded flat vector."""
    comm = ar.communicator()
    out = np.empty(shard.padded, mine.dtype)

    def run():
        comm.check_agreement("allgather", count=mine.size, dtype=dtype_code(mine.dtype))
        allgatherv(comm.transport, np.ascontiguousarray(mine), out, [shard.per_rank] * comm.size)
    in_step(run)()
    return out


def allreduce_sum(x: tf.Tensor) -> tf.Tensor:
    """Sum the small float vector ``x`` (partial squared norms) over the ranks, as a TF op."""
    def run(a):
        return in_step(lambda: ar.communicator().allreduce(a, ar.Sum))() if ar.size() > 1 else a
    y = tf.numpy_function(run, [x], x.dtype, stateful=True, name="tfops_shard_norms")
    y.set_shape(x.shape)
    return y


def _fingerprint(variables) -> tuple[str, list]:
    rows = [(str(v.name), tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name) for v in variables]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16], rows


def check_same_model(variables, what: str) -> None:
    """Raise ``MismatchError`` on every rank unless every rank passes the same (name, shape, dtype)
    list, in the same order: a shard is a range of the flat vector, so any difference would mix
    one rank's weights into another's variables."""
    if ar.size() == 1:
        return
    digest, rows = _fingerprint(variables)
    everyone = ar.allgather_object(digest)
    bad = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if not bad:
        return
    table = ar.allgather_object(rows)                  # only on a mismatch: name the first difference

    def first_difference(r: int) -> str:
        mine, ref = table[r], table[0]
        at = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
        return (f"rank {r} has {len(mine)} variables, variable {at} is "
                f"{mine[at] if at < len(mine) else 'missing'} (rank 0: {ref[at] if at < len(ref) else 'missing'})")
    raise MismatchError(f"{what}: ranks shard different variables ({'; '.join(first_difference(r) for r in bad)}). "
                        "Build the same model, with its variables in the same order, on every rank.")
