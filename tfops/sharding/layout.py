"""Where every element lives: flat, balanced shards of the trainable variables, one per dtype.

Pure functions of the variables' shapes and dtypes and of (rank, size): every rank computes
the same layout without talking (the variables are checked to agree first, :mod:`.exchange`).

Per dtype, the variables are laid end to end in model order and the flat vector is padded with
zeros to a multiple of p; rank r owns the contiguous slice ``[r*s, (r+1)*s)``, ``s = ceil(N/p)``::

    variables   |--- w0 (6) ---|-- b0 (2) --|------- w1 (9) -------|b1 1|      N = 18, p = 4
    flat        0              6            8                      17   18 20  (2 padding)
    ranks       |--- r0 (5) ---|--- r1 (5) ---|--- r2 (5) ---|--- r3 (5) ---|
    segments    r0: w0[0:5]    r1: w0[5:6] b0[0:2] w1[0:2]   r2: w1[2:7]   r3: w1[7:9] b1[0:1]

A rank's *segments* are the pieces of variables inside its slice (at most one per variable,
in model order); the inner optimizer is built over them, so its slots hold ``s`` elements per
slot instead of N, whatever the sizes of the tensors: one large embedding cannot unbalance it
(PyTorch's ZeroRedundancyOptimizer, which gives whole tensors to ranks, can).

Gradients travel in *buckets*: runs of whole variables in backprop order (last variable first,
:func:`tfops.overlap.buckets`), each a contiguous range ``[start, stop)`` of the flat vector;
the bucket holding the last variable also carries the padding. Rank r receives the part of
every bucket that falls inside its slice, so ``counts`` are uneven per bucket and sum to s.
"""
from __future__ import annotations

import dataclasses

from ..overlap import buckets as _backprop_buckets

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
    """Variables ``vars`` (model indices, ascending) covering flat ``[start, stop)``;
    ``counts[r]`` of those elements belong to rank r, the first at flat ``max(start, r*s)``."""
    vars: tuple[int, ...]
    start: int
    stop: int
    counts: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One dtype's flat space: its variables (model indices, model order), their sizes and flat
    offsets, the padded length, this rank's slice ``[lo, lo + per_rank)``, segments and buckets."""
    dtype: str
    vars: tuple[int, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    padded: int
    per_rank: int
    lo: int
    segments: tuple[Segment, ...]
    buckets: tuple[Bucket, ...]

    @property
    def padding(self) -> int:
        """Zeros after the last variable: fewer than p."""
        return self.padded - self.total


def _counts(start: int, stop: int, per_rank: int, size: int) -> tuple[int, ...]:
    return tuple(max(0, min(stop, (r + 1) * per_rank) - max(start, r * per_rank)) for r in range(size))


def _segments(sizes, offsets, var_ids, lo: int, hi: int) -> tuple[Segment, ...]:
    out = []
    for v, n, at in zip(var_ids, sizes, offsets):
        a, b = max(at, lo), min(at + n, hi)
        if a < b:
            out.append(Segment(var=v, var_start=a - at, slice_start=a - lo, size=b - a))
    return tuple(out)


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
        total = sum(sizes)
        per_rank = -(-total // size)
        padded = per_rank * size
        lo = rank * per_rank
        order = _backprop_buckets([_Sized(n, dtype) for n in sizes], bucket_bytes)
        bks = []
        for members in order:                          # positions within ids, last variable first
            start = offsets[min(members)]
            stop = padded if max(members) == len(ids) - 1 else offsets[max(members)] + sizes[max(members)]
            bks.append(Bucket(vars=tuple(ids[k] for k in sorted(members)), start=start, stop=stop,
                              counts=_counts(start, stop, per_rank, size)))
        out.append(Shard(dtype=dtype, vars=tuple(ids), sizes=tuple(sizes), offsets=tuple(offsets), total=total,
                         padded=padded, per_rank=per_rank, lo=lo,
                         segments=_segments(sizes, offsets, ids, lo, lo + per_rank), buckets=tuple(bks)))
    return out


class _Sized:
    """What :func:`tfops.overlap.buckets` reads of a tensor: ``shape.num_elements()`` and ``dtype.size``."""

    def __init__(self, n: int, dtype: str):
        import tensorflow as tf
        self.shape = tf.TensorShape([n])
        self.dtype = tf.as_dtype(dtype)
