"""Adasum: adaptive summation of gradients (Maleki et al., 2020; Horovod's ``op=hvd.Adasum``).

Two gradients ``a`` and ``b`` combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

Orthogonal gradients add (a.b = 0: a + b); equal ones average (a = b: a);
in between, the part of each along the other is counted once, not twice.
A zero vector leaves the other unchanged: a squared norm below
sqrt(DBL_MIN) keeps its coefficient at 1, as Horovod does
(``horovod/common/ops/adasum/adasum.h``). Over p ranks the pairs combine
up a binary tree over contiguous halves of the ranks, p = 4::

    level 1:   g01 = adasum(g0, g1)        g23 = adasum(g2, g3)
    level 2:   g   = adasum(g01, g23)

Vector-halving distance-doubling (VHDD) computes that tree without ever
moving a whole vector: it is ``rhd``'s reduce-scatter and allgather, where
each level's reduction is the Adasum combination of the two halves' slices.
The coefficients need the dot product and norms of the *whole* left and
right vectors, but after level l each rank holds only 1/2^l of them, so the
ranks of each level's group (the 2^l ranks that have exchanged data, directly
or not) sum their slices' partial [a.b, |left|^2, |right|^2] first, by
recursive doubling on 24 bytes. p = 4, buffer [A B C D]::

    level 1 (partner r^1)   0 keeps A B, gets 1's A B;  1 keeps C D, gets 0's C D  (2, 3 alike)
                            dot/norms summed over {0,1} and over {2,3}; combine
    level 2 (partner r^2)   0 keeps A, gets 2's A;  2 keeps B;  1 keeps C;  3 keeps D
                            dot/norms summed over {0,1,2,3}; combine
    allgather               the same exchanges in reverse: every rank ends with [A B C D]

Steps: for each level 1, 2, 4, ..., p/2: exchange halves with rank ^ level,
partial dot and norms (float64), group sum, combine my slice; then the
allgather, levels in reverse.

Arithmetic. Dot products and norms accumulate in float64 whatever the dtype
(float16, bfloat16, float32, float64); the combination runs in float64 and
is rounded once to the dtype. Each element is combined on one rank only and
then copied everywhere, and the group sums add the lower rank's value first
on both partners, so every rank's result is bitwise identical.

Power-of-two p only, as Horovod requires on CPU ("Running Adasum with
non-power of 2 nodes is not supported yet"): any other p raises
``InvalidArgumentError`` on every rank before a message is sent. One tensor
per call: the coefficients belong to the tensor (the engine never fuses
Adasum tensors; Horovod keeps per-tensor dots inside a fused buffer).

Cost (alpha = latency per message, beta = seconds per byte sent, gamma =
seconds per byte combined, about 3x a sum's: the dot, two norms and the
scaled add; n = bytes, L = log2 p)::

    T = (2 L + L (L + 1) / 2) alpha  +  2 (p-1)/p n beta  +  (p-1)/p n gamma

rhd's bandwidth, plus L (L + 1) / 2 latency terms for the group sums.
"""
from __future__ import annotations

import numpy as np

from ..buffers import Workspace
from ..errors import InvalidArgumentError
from ..ops import Op, bfloat16
from ..transport.base import Transport

__all__ = ["allreduce", "combine", "reference", "DTYPES"]

TAG = 30                  # slices; the group sums use TAG + 1
_TINY = np.sqrt(np.finfo(np.float64).tiny)    # Horovod's sqrt(DBL_MIN): a smaller |v|^2 counts as 0

#: The dtypes Adasum combines (Horovod: float16, float32, float64; bfloat16 comes along for free).
DTYPES = frozenset(np.dtype(d) for d in (np.float16, bfloat16, np.float32, np.float64))


def _coefficients(dot: float, left_sq: float, right_sq: float) -> tuple[float, float]:
    """The Adasum coefficients of the left and right vector from their dot product and squared norms."""
    c_left = 1.0 - dot / left_sq * 0.5 if left_sq >= _TINY else 1.0
    c_right = 1.0 - dot / right_sq * 0.5 if right_sq >= _TINY else 1.0
    return c_left, c_right


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` of two whole vectors, in float64 (the reference's pairwise step)."""
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    c_a, c_b = _coefficients(float(a @ b), float(a @ a), float(b @ b))
    return c_a * a + c_b * b


def reference(vectors: list[np.ndarray]) -> np.ndarray:
    """Adasum of every rank's vector in float64: the same binary tree over contiguous halves."""
    if len(vectors) == 1:
        return np.asarray(vectors[0], np.float64).reshape(-1)
    half = len(vectors) // 2
    return combine(reference(vectors[:half]), reference(vectors[half:]))


def check(p: int, dtype, rank: int) -> None:
    """Raise ``InvalidArgumentError`` (locally, on every rank alike) unless Adasum can run here."""
    if p & (p - 1):
        raise InvalidArgumentError(f"rank {rank}: Adasum needs a power-of-two number of ranks (as Horovod "
                                   f"does on CPU); this job has {p}. Use op=Average or Sum, or run on "
                                   f"{1 << (p.bit_length() - 1)} or {1 << p.bit_length()} ranks")
    if np.dtype(dtype) not in DTYPES:
        raise InvalidArgumentError(f"rank {rank}: Adasum combines floating-point tensors (float16, bfloat16, "
                                   f"float32, float64); got {np.dtype(dtype)}")


def _group_sum(comm: Transport, values: np.ndarray, scratch: np.ndarray, level: int) -> None:
    """Sum ``values`` (float64) over the 2*level ranks that share this rank's bits above ``level``:
    recursive doubling, the lower rank's value first on both partners (bitwise the same sums)."""
    rank, mask = comm.rank, 1
    while mask <= level:
        peer = rank ^ mask
        comm.exchange(values, scratch, peer, TAG + 1)            # swap the partial sums
        if rank < peer:
            np.add(values, scratch, out=values)
        else:
            np.add(scratch, values, out=values)
        mask <<= 1


def allreduce(comm: Transport, buf: np.ndarray, op: Op = Op.ADASUM, *, workspace: Workspace,
              segment_bytes: int = 0) -> None:
    """Adasum of every rank's ``buf`` (contiguous, 1-D, floating point), in place.

    ``op`` is accepted for the algorithms' common signature and must be ``Op.ADASUM``;
    ``segment_bytes`` is unused (each level is one message each way, as in ``rhd``).
    """
    p, rank, count = comm.size, comm.rank, buf.size
    check(p, buf.dtype, rank)
    if p == 1:
        return
    scratch = workspace.get("adasum.recv", count, buf.dtype)
    mine64 = workspace.get("adasum.mine64", count, np.float64)
    theirs64 = workspace.get("adasum.theirs64", count, np.float64)
    sums, incoming = np.zeros(3, np.float64), np.zeros(3, np.float64)
    lo, hi, level, spans = 0, count, 1, []

    # Vector halving: trade halves with rank ^ level, combine the half I keep.
    while level < p:
        comm.mark("reduce-scatter", level.bit_length() - 1)
        peer, mid = rank ^ level, lo + (hi - lo) // 2
        left = rank & level == 0
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        spans.append((peer, keep, give))
        n = keep[1] - keep[0]
        comm.swap(buf[give[0]:give[1]], scratch[:n], peer, TAG)
        mine, theirs = mine64[:n], theirs64[:n]
        mine[...] = buf[keep[0]:keep[1]]                       # float64 copies: dots and the combination
        theirs[...] = scratch[:n]
        own_sq, other_sq = float(mine @ mine), float(theirs @ theirs)
        sums[:] = (float(mine @ theirs), own_sq, other_sq) if left else (float(mine @ theirs), other_sq, own_sq)
        _group_sum(comm, sums, incoming, level)                # whole-vector dot and norms of this level
        c_left, c_right = _coefficients(*sums.tolist())
        c_mine, c_theirs = (c_left, c_right) if left else (c_right, c_left)
        np.multiply(mine, c_mine, out=mine)
        np.multiply(theirs, c_theirs, out=theirs)
        np.add(mine, theirs, out=mine)
        buf[keep[0]:keep[1]] = mine                            # rounded once to the dtype
        lo, hi = keep
        level <<= 1

    # Distance doubling: send my finished range, receive the partner's adjacent one in place.
    for step, (peer, keep, give) in enumerate(reversed(spans)):
        comm.mark("allgather", step)
        comm.swap(buf[keep[0]:keep[1]], buf[give[0]:give[1]], peer, TAG)
