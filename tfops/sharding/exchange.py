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

Every call takes the communicator it runs on (``comm``): the world's, or a process set's
(:func:`communicator_of`), whose ranks and size are then the set's own.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import mmap
import threading

import numpy as np
import tensorflow as tf

import allreduce as ar
from allreduce.algorithms.allgather import allgatherv
from allreduce.algorithms.reducescatter import reducescatter as _ring_reducescatter
from allreduce.buffers import aligned_empty
from allreduce.ops import dtype_code
from allreduce.process_sets import ProcessSet

from ..errors import MismatchError, tf_typed
from ..collectives.dispatch import in_step
from .layout import Bucket, Segment, Shard

__all__ = ["IN_FLIGHT_BYTES", "ReduceScatters", "reducescatter_bucket", "allgather_bucket", "allreduce_sum",
           "check_same_model", "check_process_set", "communicator_of"]


IN_FLIGHT_BYTES = 4 << 20
"""Stage 2: gradient bytes handed to the reduce-scatter thread and not yet reduced, at most (one
bucket larger than this goes alone). Past it the next bucket's hand-over waits, and with it the
backprop that only later buckets need (:func:`tfops.overlap._submit_first`): without the bound a
ring slower than backprop could keep every gradient waiting until the step's end, as much as
stage 1 holds (BENCHMARKS.md "Sharding")."""


def check_process_set(process_set):
    """``process_set`` if it is None or a :class:`tfops.ProcessSet`, else ``TypeError``."""
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise TypeError(f"ShardedOptimizer: process_set must be a tfops.ProcessSet (or None for every rank), got "
                        f"{type(process_set).__name__}")
    return process_set


def communicator_of(process_set):
    """The communicator of ``process_set`` (None or the global set: the world's). A set that is not
    registered, or a rank outside it, raises ``allreduce.InvalidArgumentError`` (a ``ValueError``)
    naming the rank and the set."""
    if process_set is None or process_set.process_set_id == 0:
        return ar.communicator()
    return process_set.communicator


KEEP_PACKS = 2
"""Free pack buffers kept per dtype between steps (each at most a bucket): stage 1, with no bound
in flight, may pack every small bucket at once; keeping them all would hold their total."""


def mapped_empty(count: int, dtype) -> np.ndarray:
    """A new array for a step's result: from a mapping of its own if 1 MiB or more (page-aligned,
    so TF takes it without a copy, and handed back to the kernel the moment it is freed), else
    64-byte aligned from the heap. glibc's default puts a freed large block's size into its mmap
    threshold (up to 32 MiB), so the next step's blocks of that size came from its heaps, which
    keep what is freed: at -np 4 each step's 16 MiB slices stayed resident (issue 44)."""
    dtype = np.dtype(dtype)
    if count * dtype.itemsize < 1 << 20:
        return aligned_empty(count, dtype)
    return np.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype)


class ReduceScatters:
    """One step's reduce-scatters, run in submission order on one thread of their own.

    The ring of a bucket blocks its caller until every rank has sent its part. Run on TF's
    thread it would hold backprop up for that long (with one inter-op thread, backprop stopped
    while the link worked); here ``submit`` hands the bucket over and returns, and one worker
    thread, first in first out, runs the rings: every rank runs them in the same order. Each
    ring writes this rank's piece straight into its place in the rank's slice (one array per
    dtype), and ``wait`` returns the slice's segments, after every ring has finished, and raises
    the first error any of them raised (on every rank: the check and the ring fail alike
    everywhere). (Aligned per-segment arrays, which TF takes without its copy, were tried: they
    peaked 128 MiB higher at 151 M parameters, -np 4; why was not found.)

    What a bucket's ring reads (``submit``), in both stages:

    - one variable: TF's gradient itself, read in place (``keep_input``), held until its ring is
      done, then freed;
    - several variables (each smaller than a bucket): packed into a buffer reused from step to
      step (``_packs``, at most :data:`KEEP_PACKS` kept between steps, each at most a bucket).

    Nothing this class keeps between steps is larger than a bucket: a bucket's ring runs a block
    of ``block_bytes`` of every piece at a time (:func:`reducescatter_bucket`), so the ring's two
    workspace slots are a block each, not a piece of the largest variable (at p = 2 those were
    half the model, rounded up to a power of two, kept for the run). Stage 2 bounds the bytes in
    flight (``in_flight_bytes``, :data:`IN_FLIGHT_BYTES`); stage 1 (None) lets every gradient wait
    for its ring, the 4N of its formula: TF's gradients, not a copy of them.
    """

    _worker: concurrent.futures.ThreadPoolExecutor | None = None

    def __init__(self, shards: list[Shard], *, comm, block_bytes: int, in_flight_bytes: int | None = None):
        self._shards, self._comm, self._block_bytes = shards, comm, block_bytes
        self._pending: list[concurrent.futures.Future] = []
        self._slices: dict[int, np.ndarray] = {}
        self._limit = in_flight_bytes
        self._in_flight = 0
        self._room = threading.Condition()
        self._packs: dict[int, list[np.ndarray]] = {}        # shard -> free pack buffers, each as large
        self._pack_size = [max([b.stop - b.start for b in sh.buckets if len(b.vars) > 1], default=0)
                           for sh in shards]                 # as its largest bucket of several variables

    @classmethod
    def _pool(cls) -> concurrent.futures.ThreadPoolExecutor:
        if cls._worker is None:                           # one thread: the rings run in submission order
            cls._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tfops-shard-rs")
        return cls._worker

    def submit(self, arrays: list[np.ndarray], k: int, b: int, *, first: bool = False) -> int:
        """Queue the ring of bucket ``b`` of shard ``k`` over ``arrays`` (the gradients of its
        variables, ascending; see the class). Returns the bucket's position in the queue."""
        shard = self._shards[k]
        bucket = shard.buckets[b]
        dtype = np.dtype(shard.dtype)
        n = bucket.stop - bucket.start
        keep, pack = False, None
        nbytes = n * dtype.itemsize if self._limit is not None else 0
        self._admit(nbytes)                              # stage 2: wait for room (before taking any)
        try:
            if len(arrays) == 1:
                buf, keep = np.ascontiguousarray(arrays[0], dtype).reshape(-1), True
            else:
                pack = self._take_pack(k)
                buf = pack[:n]
                self._pack(arrays, shard, bucket, buf)
            at = shard.piece_at[b]
            out = self._slice(k)[at:at + bucket.counts[self._comm.rank]]   # the ring writes its result in place
        except BaseException:
            self._release(nbytes)                        # else the next step's hand-over would wait forever
            raise
        hold = [buf]                                     # the ring drops it the moment it is done
        block = max(1, self._block_bytes // dtype.itemsize)

        def ring():
            try:
                reducescatter_bucket(hold.pop(), bucket, out, comm=self._comm, first=first, keep_input=keep,
                                     block=block)
            finally:
                if pack is not None and len(self._packs[k]) < KEEP_PACKS:
                    self._packs[k].append(pack)
                self._release(nbytes)
        self._pending.append(self._pool().submit(ring))
        return len(self._pending) - 1

    def wait(self, segments: list[tuple[int, Segment]]) -> list[np.ndarray]:
        """This rank's slice of the averaged gradients as ``segments`` ((shard index, segment)
        pairs) ask, once every submitted ring has finished."""
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
        slices, self._slices = self._slices, {}
        for f in pending:
            if f.exception() is not None:
                raise f.exception()
        return [slices[k][s.slice_start:s.slice_start + s.size] for k, s in segments]

    # -- buffers ---------------------------------------------------------------------------
    def _slice(self, k: int) -> np.ndarray:
        """This step's slice of shard ``k`` (``per_rank`` elements), where the rings write."""
        if k not in self._slices:
            self._slices[k] = mapped_empty(self._shards[k].per_rank, self._shards[k].dtype)
        return self._slices[k]

    @staticmethod
    def _pack(arrays, shard: Shard, bucket: Bucket, buf: np.ndarray) -> None:
        for v, a in zip(bucket.vars, arrays):
            k = shard.vars.index(v)
            at = shard.offsets[k] - bucket.start
            buf[at:at + shard.sizes[k]] = a.reshape(-1)

    def _take_pack(self, k: int) -> np.ndarray:
        free = self._packs.setdefault(k, [])
        return free.pop() if free else np.empty(self._pack_size[k], self._shards[k].dtype)

    def _admit(self, nbytes: int) -> None:
        with self._room:
            while self._in_flight and self._in_flight + nbytes > self._limit:
                self._room.wait()
            self._in_flight += nbytes

    def _release(self, nbytes: int) -> None:
        with self._room:
            self._in_flight -= nbytes
            self._room.notify_all()


def reducescatter_bucket(buf: np.ndarray, bucket: Bucket, out: np.ndarray, *, comm=None, first: bool = False,
                         keep_input: bool = False, block: int | None = None) -> np.ndarray:
    """Average ``buf`` (a bucket laid out flat) over the ranks into ``out`` (this rank's piece,
    ``bucket.counts[rank]`` elements), which it returns. ``buf`` is
    overwritten by the ring unless ``keep_input``. ``first``: the step's first collective, which
    meets the other ranks through :func:`tfops.ops.in_step`; the step's later ones follow in the
    same order on every rank (one rendezvous a step, not one per bucket: ~0.1 ms each). ``comm``:
    the communicator (default the world's). ``block``: reduce ``block`` elements of every piece
    per ring (the same slice of each), so the ring's scratch is a block, not a piece; the same
    additions in the same order, so the same bits. Cost: (p-1) alpha more per extra block."""
    comm = comm or ar.communicator()
    starts = [bucket.piece(r)[0] - bucket.start for r in range(len(bucket.counts))]
    step = block or max(bucket.counts)

    def run():
        comm.check_agreement("reducescatter", count=buf.size, dtype=dtype_code(buf.dtype), op=int(ar.Average))
        for at in range(0, max(max(bucket.counts), 1), step):
            counts = [min(max(c - at, 0), step) for c in bucket.counts]
            _ring_reducescatter(comm.transport, buf, out[at:at + counts[comm.rank]], counts, ar.Average,
                                workspace=comm.workspace, keep_input=keep_input, offsets=[s + at for s in starts])
    in_step(run, comm)() if first else run()
    return out


def allgather_bucket(mine: np.ndarray, shard: Shard, bucket: Bucket, *, comm=None) -> list[np.ndarray]:
    """Every rank's part of ``bucket`` (``mine``: this rank's ``counts[rank]`` updated elements), laid
    end to end: the bucket's variables, flat, in ``bucket.vars`` order. One bucket at a time, so
    the whole model is never held twice."""
    comm = comm or ar.communicator()
    out = mapped_empty(bucket.stop - bucket.start, mine.dtype)    # aligned: TF takes it without a copy
    if comm.size == 1:
        out[:] = mine
    else:                                                 # in step: after the step's reduce-scatters
        comm.check_agreement("allgather", count=out.size, dtype=dtype_code(mine.dtype))
        allgatherv(comm.transport, np.ascontiguousarray(mine), out, list(bucket.counts))
    return [out[shard.offsets[k] - bucket.start:][:shard.sizes[k]]
            for k in (shard.vars.index(v) for v in bucket.vars)]


def allreduce_sum(x: tf.Tensor, *, comm=None) -> tf.Tensor:
    """Sum the small float vector ``x`` (partial squared norms) over the ranks of ``comm`` (default
    the world's), as a TF op."""
    comm = comm or ar.communicator()

    def run(a):
        return comm.allreduce(a, ar.Sum) if comm.size > 1 else a   # after the reduce-scatters
    y = tf.numpy_function(tf_typed(run), [x], x.dtype, stateful=True, name="tfops_shard_norms")
    y.set_shape(x.shape)
    return y


def _fingerprint(variables) -> tuple[str, list]:
    rows = [(str(v.name), tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name) for v in variables]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16], rows


def check_same_model(variables, what: str, *, comm=None) -> None:
    """Raise ``MismatchError`` on every rank unless every rank passes the same (name, shape, dtype)
    list, in the same order: a shard is a range of the flat vector, so any difference would mix
    one rank's weights into another's variables. ``comm``: the ranks compared (default the world);
    ranks are named by their index in it."""
    comm = comm or ar.communicator()
    if comm.size == 1:
        return
    digest, rows = _fingerprint(variables)
    everyone = comm.allgather_object(digest)
    bad = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if not bad:
        return
    table = comm.allgather_object(rows)                # only on a mismatch: name the first difference

    def first_difference(r: int) -> str:
        mine, ref = table[r], table[0]
        at = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
        return (f"rank {r} has {len(mine)} variables, variable {at} is "
                f"{mine[at] if at < len(mine) else 'missing'} (rank 0: {ref[at] if at < len(ref) else 'missing'})")
    raise MismatchError(f"{what}: ranks shard different variables ({'; '.join(first_difference(r) for r in bad)}). "
                        "Build the same model, with its variables in the same order, on every rank.")
