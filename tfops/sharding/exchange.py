"""The sharded step's collectives, on numpy arrays: reduce-scatter a bucket, allgather the slices,
sum small vectors of partial norms, and check that every rank shards the same model.

The ring allreduce of lesson 2 is these two halves back to back; ZeRO runs the optimizer step
between them::

    bucket of gradients  --reduce-scatter (Average)-->  my part of the bucket    (p-1)/p n bytes sent
    my part of a bucket  --allgather-->                 the bucket's weights     (p-1)/p n bytes sent

Both halves go over the ring (``allreduce.algorithms.reducescatter``, ``.allgather``), bucket by
bucket, each bucket cut into p pieces that differ by at most one element (:mod:`.layout`), so a
sharded step sends what one ring allreduce sends, 2 (p-1)/p n bytes per rank in 2 (p-1) alpha
per bucket, and every link carries as many bytes each way. The reduce-scatters run on a thread
of their own (:class:`ReduceScatters`), so they overlap backprop as the engine's allreduce
does; the allgathers come after the optimizer step, which needs every bucket. A step's first
call goes through :func:`tfops.ops.in_step` (the engine's out-of-step check); every call through
``Communicator.check_agreement`` (same collective, count and dtype on every rank, else
``MismatchError`` on every rank).
"""
from __future__ import annotations

import concurrent.futures
import hashlib

import numpy as np
import tensorflow as tf

import allreduce as ar
from allreduce.algorithms.allgather import allgatherv
from allreduce.algorithms.reducescatter import reducescatter as _ring_reducescatter
from allreduce.ops import dtype_code

from ..errors import MismatchError, tf_typed
from ..ops import in_step
from .layout import Bucket, Shard

__all__ = ["ReduceScatters", "reducescatter_bucket", "allgather_bucket", "allreduce_sum", "check_same_model"]


class ReduceScatters:
    """One step's reduce-scatters, run in submission order on one thread of their own.

    The ring of a bucket blocks its caller until every rank has sent its part. Run on TF's
    thread it would hold backprop up for that long (with one inter-op thread, backprop stopped
    while the link worked); here ``submit`` packs the bucket
    into a buffer of its own (TF may free the gradients at once) and returns, and one worker
    thread, first in first out, runs the rings: every rank runs them in the same order.
    ``wait`` returns every bucket's part, after all of them have finished, and raises the first
    error any of them raised (on every rank: the check and the ring fail alike everywhere).
    """

    _worker: concurrent.futures.ThreadPoolExecutor | None = None

    def __init__(self):
        self._pending: list[concurrent.futures.Future] = []

    @classmethod
    def _pool(cls) -> concurrent.futures.ThreadPoolExecutor:
        if cls._worker is None:                           # one thread: the rings run in submission order
            cls._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tfops-shard-rs")
        return cls._worker

    def submit(self, arrays: list[np.ndarray], shard: Shard, bucket: Bucket, buf: np.ndarray | None, *,
               first: bool = False) -> int:
        """Lay ``arrays`` (the gradients of ``bucket.vars``, ascending) out flat in ``buf`` (``stop -
        start`` elements; None: a new one) and queue the ring; returns the bucket's position."""
        if buf is None:
            buf = np.empty(bucket.stop - bucket.start, arrays[0].dtype if arrays else np.float32)
        for v, a in zip(bucket.vars, arrays):
            k = shard.vars.index(v)
            at = shard.offsets[k] - bucket.start
            buf[at:at + shard.sizes[k]] = a.reshape(-1)
        self._pending.append(self._pool().submit(reducescatter_bucket, buf, bucket, first=first))
        return len(self._pending) - 1

    def wait(self) -> list[np.ndarray]:
        """Every submitted bucket's part (this rank's ``counts[rank]`` elements), in order."""
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
        for f in pending:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in pending]


def reducescatter_bucket(buf: np.ndarray, bucket: Bucket, *, first: bool = False) -> np.ndarray:
    """Average ``buf`` (a bucket laid out flat) over the ranks; return this rank's piece,
    ``bucket.counts[rank]`` elements; ``buf`` is overwritten by the ring. ``first``: the step's
    first collective, which meets the other ranks through :func:`tfops.ops.in_step`; the step's
    later ones follow in the same order on every rank (one rendezvous a step, not one per
    bucket: ~0.1 ms each)."""
    comm = ar.communicator()
    out = np.empty(bucket.counts[comm.rank], buf.dtype)

    def run():
        comm.check_agreement("reducescatter", count=buf.size, dtype=dtype_code(buf.dtype), op=int(ar.Average))
        _ring_reducescatter(comm.transport, buf, out, bucket.counts, ar.Average, workspace=comm.workspace)
    in_step(run)() if first else run()
    return out


def allgather_bucket(mine: np.ndarray, shard: Shard, bucket: Bucket) -> list[np.ndarray]:
    """Every rank's part of ``bucket`` (``mine``: this rank's ``counts[rank]`` updated elements), laid
    end to end: the bucket's variables, flat, in ``bucket.vars`` order. One bucket at a time, so
    the whole model is never held twice."""
    comm = ar.communicator()
    out = np.empty(bucket.stop - bucket.start, mine.dtype)

    def run():
        comm.check_agreement("allgather", count=out.size, dtype=dtype_code(mine.dtype))
        allgatherv(comm.transport, np.ascontiguousarray(mine), out, list(bucket.counts))
    if comm.size == 1:
        out[:] = mine
    else:
        run()                                             # in step: after the step's reduce-scatters
    return [out[shard.offsets[k] - bucket.start:][:shard.sizes[k]]
            for k in (shard.vars.index(v) for v in bucket.vars)]


def allreduce_sum(x: tf.Tensor) -> tf.Tensor:
    """Sum the small float vector ``x`` (partial squared norms) over the ranks, as a TF op."""
    def run(a):
        return ar.communicator().allreduce(a, ar.Sum) if ar.size() > 1 else a   # after the reduce-scatters
    y = tf.numpy_function(tf_typed(run), [x], x.dtype, stateful=True, name="tfops_shard_norms")
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
