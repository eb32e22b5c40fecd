"""Recursive halving-doubling allreduce (Rabenseifner): reduce-scatter, then allgather, in log2 p steps.

The buffer is cut into q blocks (q = the largest power of two <= p, blocks
from ``partition.chunks``). Core rank r ends up owning block r.

Recursive halving (the reduce-scatter), p = 4, blocks A B C D, partner =
rank ^ mask with mask = q/2, q/4, ..., 1::

    step 0 (mask 2)   0 <-> 2, 1 <-> 3: trade halves of [A B C D]
          rank 0 keeps A B, sends C D     rank 2 keeps C D, sends A B
          rank 1 keeps A B, sends C D     rank 3 keeps C D, sends A B
    step 1 (mask 1)   0 <-> 1, 2 <-> 3: trade halves of what is kept
          rank 0 keeps A    rank 1 keeps B    rank 2 keeps C    rank 3 keeps D

After step k each rank holds the sum over 2^(k+1) ranks of 1/2^(k+1) of the
buffer; after log2 q steps rank r holds the full sum of block r.

Recursive doubling (the allgather) runs the same exchanges in reverse,
mask = 1, 2, ..., q/2: each rank sends its finished range to its partner
and receives the partner's, which is adjacent, so the range doubles.

Non-power-of-two p (the standard fold). With rem = p - q, ranks below
2*rem pair up: odd rank 2i+1 sends its whole buffer to even rank 2i, which
reduces it and becomes core rank i; the odd ranks sit out. Ranks from
2*rem on become core ranks r - rem. At the end each even rank sends the
result back to its odd partner. p = 6::

    fold     1 -> 0, 3 -> 2            core: 0 2 4 5  (core ranks 0 1 2 3)
    halving + doubling on the 4 core ranks, as above
    unfold   0 -> 1, 2 -> 3

Steps: fold, reduce-scatter 0..log2 q - 1, allgather 0..log2 q - 1, unfold.
Each element is finally reduced on one rank only (its block's owner), with
Average's divide fused into that last reduction, and then copied
everywhere, so every rank's result is bitwise identical.

Cost (alpha = latency per message, beta = seconds per byte sent, gamma =
seconds per byte reduced, n = bytes, q = p for a power of two):

    T = 2 log2 q alpha  +  2 (q-1)/q n beta  +  (q-1)/q n gamma
        + (fold, p not a power of two)  2 alpha + 2 n beta + n gamma

Ring's bandwidth with 2 log2 p latency terms instead of 2(p-1), so it wins
in the middle sizes; when p is not a power of two the fold adds two
latencies and 2 n beta, which ring does not pay.
Every step is one message each way (``segment_bytes`` is accepted for the
common signature but unused: pipelining would only add latency terms).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import kernels, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport.base import Transport

__all__ = ["allreduce", "core_layout", "halving_plan"]

TAG = 13


def core_layout(p: int, rank: int) -> tuple[int, int, int]:
    """``(q, rem, core_rank)``: the power-of-two core, ranks folded away, this rank's core rank.

    ``core_rank`` is -1 for an odd rank below ``2 * rem`` (it sits out the core).
    """
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    if rank < 2 * rem:
        return q, rem, rank // 2 if rank % 2 == 0 else -1
    return q, rem, rank - rem


def _real_rank(core_rank: int, rem: int) -> int:
    return 2 * core_rank if core_rank < rem else core_rank + rem


@lru_cache(maxsize=256)
def halving_plan(count: int, q: int, core_rank: int) -> tuple[tuple[int, tuple[int, int], tuple[int, int]], ...]:
    """For each halving step: ``(partner core rank, (off, n) kept, (off, n) sent)``.

    The doubling runs these steps in reverse, receiving what was sent.
    Cached: it is on the hot path and depends only on its arguments.
    """
    blocks = partition.chunks(count, q)

    def span(lo: int, hi: int) -> tuple[int, int]:
        start = blocks[lo][0]
        return start, blocks[hi - 1][0] + blocks[hi - 1][1] - start

    plan, lo, hi, mask = [], 0, q, q >> 1
    while mask:
        mid = (lo + hi) // 2
        if core_rank & mask:
            keep, give, lo = span(mid, hi), span(lo, mid), mid
        else:
            keep, give, hi = span(lo, mid), span(mid, hi), mid
        plan.append((core_rank ^ mask, keep, give))
        mask >>= 1
    return tuple(plan)


def allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int = 0) -> None:
    """Reduce ``buf`` (contiguous, 1-D) in place across all ranks of ``comm``."""
    p, rank, count = comm.size, comm.rank, buf.size
    if p == 1 or count == 0:
        kernels.finish(buf, op, p)
        return
    q, rem, core = core_layout(p, rank)
    scratch = workspace.get("rhd.scratch", count, buf.dtype)

    # Fold: the first 2*rem ranks pair up so a power-of-two core remains.
    if rank < 2 * rem:
        comm.mark("fold", 0)
        if core < 0:
            comm.send(buf, rank - 1, TAG)                    # hand my whole buffer to my even partner
        else:
            comm.recv(scratch, rank + 1, TAG)                # wait for the odd partner's buffer
            kernels.reduce_into(buf, scratch, op)

    if core >= 0:
        plan = halving_plan(count, q, core)
        # Recursive halving: trade the half the partner keeps for my half of the partner's data.
        for step, (peer, (k_off, k_n), (g_off, g_n)) in enumerate(plan):
            comm.mark("reduce-scatter", step)
            incoming = scratch[:k_n]
            comm.swap(buf[g_off:g_off + g_n], incoming, _real_rank(peer, rem), TAG)
            mine = buf[k_off:k_off + k_n]
            if step < len(plan) - 1:
                kernels.reduce_into(mine, incoming, op)
            else:
                kernels.reduce_finish_into(mine, incoming, op, p)   # last reduction: fuse Average's / p
        # Recursive doubling: send my finished range, receive the partner's adjacent one in place.
        for step, (peer, (k_off, k_n), (g_off, g_n)) in enumerate(reversed(plan)):
            comm.mark("allgather", step)
            comm.swap(buf[k_off:k_off + k_n], buf[g_off:g_off + g_n], _real_rank(peer, rem), TAG)

    # Unfold: the even ranks return the result to the odd ranks that sat out.
    if rank < 2 * rem:
        comm.mark("unfold", 0)
        if core < 0:
            comm.recv(buf, rank - 1, TAG)                    # the finished buffer, copied: bitwise equal
        else:
            comm.send(buf, rank + 1, TAG)
