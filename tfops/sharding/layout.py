"""Where every element lives: flat, balanced shards of the trainable variables, one per dtype.

Pure functions of the variables' shapes and dtypes and of (rank, size): every rank computes
the same layout without talking (the variables are checked to agree first, :mod:`.exchange`).

Per dtype, the variables are laid end to end in model order. Gradients travel in *buckets*:
runs of whole variables in backprop order (last variable first, :func:`tfops.overlap.buckets`),
each a contiguous range ``[start, stop)`` of the flat vector; a variable larger than a bucket is
a bucket of its own (stage 2 then reduces TF's gradient in place, with no copy). Every bucket is cut into p
contiguous *pieces*, one per rank in rank order, whose sizes differ by at most one element;
rank r owns piece r of every bucket. Its *slice* is its pieces laid end to end in flat order::

    variables   |--- w0 (6) ---|b0 2|------- w1 (9) -------|b1|       N = 18, p = 4
    buckets     |------ bucket 1 (8) ------|------ bucket 0 (10) -----|   (backprop: bucket 0 first)
    pieces      | r0 2| r1 2| r2 2| r3 2|  |r0 3 |r1 3 | r2 2 | r3 2 |
    segments    r0: w0[0:2] w1[0:3]   r1: w0[2:4] w1[3:6]   r2: w0[4:6] w1[6:8]   r3: b0[0:2] w1[8:9] b1

Why pieces of every bucket, not one contiguous ``[r*s, (r+1)*s)`` of the whole flat vector: a
bucket then lies mostly inside one or two ranks' slices, so its reduce-scatter is a *reduce* to
them. Every other rank sends and the owner only receives: each link carries bytes in one
direction at a time, and a full-duplex link moves the step's bytes at half its speed (measured
on the 1 Gbit/s cluster: 1.42x DistributedOptimizer's step, see BENCHMARKS.md "Sharding").
Pieces of every bucket make each bucket's reduce-scatter and allgather the balanced ring of
lesson 2 (PyTorch FSDP shards each flat parameter the same way). A rank's *segments* are the
pieces of variables inside its pieces: at most one per variable, since a variable lies in one
bucket and a piece is contiguous. The inner optimizer is built over them, so its slots hold
about N/p elements whatever the sizes of the tensors: one large embedding cannot unbalance it
(PyTorch's ZeroRedundancyOptimizer, which gives whole tensors to ranks, can).

The remainder of a bucket that p does not divide goes one element each to the next ranks in
turn, continuing from where the previous bucket's stopped, so every rank owns ``floor(N/p)`` or
``ceil(N/p)`` elements: nothing is padded.
"""
from __future__ import annotations

import dataclasses

from allreduce.partition import chunk_sizes

from ..training.overlap import BUCKET_BYTES, buckets as _backprop_buckets

__all__ = ["Segment", "Bucket", "Shard", "shards"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``[var_start, var_start + size)`` of variable ``var`` (flattened), at
    ``slice_start`` within this rank's slice."""
    var: int
    var_start: int
    slice_start: int
    size: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Variables ``vars`` (model indices, ascending) covering flat ``[start, stop)``; rank r's
    piece is the next ``counts[r]`` elements after the pieces of ranks 0..r-1."""
    vars: tuple[int, ...]
    start: int
    stop: int
    counts: tuple[int, ...]

    def piece(self, r: int) -> tuple[int, int]:
        """Flat ``[first, last)`` of rank ``r``'s piece."""
        first = self.start + sum(self.counts[:r])
        return first, first + self.counts[r]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One dtype's flat space: its variables (model indices, model order), their sizes and flat
    offsets, the buckets (backprop order), this rank's element count, where each bucket's piece
    starts in this rank's slice (``piece_at``, aligned with ``buckets``) and its segments."""
    dtype: str
    vars: tuple[int, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    per_rank: int
    buckets: tuple[Bucket, ...]
    piece_at: tuple[int, ...]
    segments: tuple[Segment, ...]

    def bucket_of(self, var: int) -> Bucket:
        """The bucket that carries model variable ``var``."""
        return next(b for b in self.buckets if var in b.vars)

    def var_counts(self, var: int) -> list[int]:
        """How many elements of model variable ``var`` each rank owns (in rank order, the pieces
        lie in the variable's flat order)."""
        k = self.vars.index(var)
        at, n, b = self.offsets[k], self.sizes[k], self.bucket_of(var)
        return [max(0, min(at + n, hi) - max(at, lo)) for lo, hi in (b.piece(r) for r in range(len(b.counts)))]


def _split(n: int, size: int, turn: int) -> tuple[int, ...]:
    """``n`` elements over ``size`` ranks (:func:`allreduce.partition.chunk_sizes`), the one-larger
    pieces starting at rank ``turn`` (cyclically)."""
    sizes = chunk_sizes(n, size)
    return tuple(sizes[(r - turn) % size] for r in range(size))


def shards(variables, rank: int, size: int, bucket_bytes: int | None = None) -> list[Shard]:
    """The layout of ``variables`` (anything with ``.shape`` and ``.dtype``) on ``rank`` of
    ``size``: one :class:`Shard` per dtype, in order of first appearance."""
    import tensorflow as tf
    by_dtype: dict[str, list[int]] = {}
    for i, v in enumerate(variables):
        by_dtype.setdefault(tf.as_dtype(v.dtype).name, []).append(i)
    out = []
    for dtype, ids in by_dtype.items():
        sizes = [int(tf.TensorShape(variables[i].shape).num_elements()) for i in ids]
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        bks, turn = [], 0
        for members in _alone_if_large(_backprop_buckets([_Sized(n, dtype) for n in sizes], bucket_bytes),
                                       sizes, tf.as_dtype(dtype).size, bucket_bytes):
            start = offsets[min(members)]                  # positions within ids, last variable first
            stop = offsets[max(members)] + sizes[max(members)]
            bks.append(Bucket(vars=tuple(ids[k] for k in sorted(members)), start=start, stop=stop,
                              counts=_split(stop - start, size, turn)))
            turn = (turn + (stop - start)) % size
        at, piece_at = 0, {}
        for b in sorted(bks, key=lambda b: b.start):       # the slice: this rank's pieces in flat order
            piece_at[b.start], at = at, at + b.counts[rank]
        bucket_of = {v: b for b in bks for v in b.vars}
        segments = []
        for v, n, off in zip(ids, sizes, offsets):
            b = bucket_of[v]
            lo, hi = b.piece(rank)
            first, last = max(off, lo), min(off + n, hi)
            if first < last:
                segments.append(Segment(var=v, var_start=first - off, slice_start=piece_at[b.start] + first - lo,
                                        size=last - first))
        out.append(Shard(dtype=dtype, vars=tuple(ids), sizes=tuple(sizes), offsets=tuple(offsets), total=sum(sizes),
                         per_rank=at, buckets=tuple(bks), piece_at=tuple(piece_at[b.start] for b in bks),
                         segments=tuple(segments)))
    return out


def _alone_if_large(groups: list[list[int]], sizes: list[int], itemsize: int, bucket_bytes: int | None) -> list[list[int]]:
    """The engine's buckets with every variable larger than a bucket taken out into one of its own
    (the engine's bucket closes only after it passes ``bucket_bytes``, so a large tensor joins the
    small ones before it). A bucket of one variable is reduced straight out of TF's gradient,
    with no copy (:class:`.exchange.ReduceScatters`). Each group stays in backprop order, and
    what is left of it is cut into runs of adjacent variables, so a bucket stays contiguous."""
    limit = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    out: list[list[int]] = []
    for group in groups:                                   # positions, last variable first
        run: list[int] = []
        for i in group:
            if sizes[i] * itemsize > limit or (run and run[-1] != i + 1):
                out += [run] if run else []
                run = []
            if sizes[i] * itemsize > limit:
                out.append([i])
            else:
                run.append(i)
        out += [run] if run else []
    return out


class _Sized:
    """What :func:`tfops.overlap.buckets` reads of a tensor: ``shape.num_elements()`` and ``dtype.size``."""

    def __init__(self, n: int, dtype: str):
        import tensorflow as tf
        self.shape = tf.TensorShape([n])
        self.dtype = tf.as_dtype(dtype)
