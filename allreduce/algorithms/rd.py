"""Recursive doubling allreduce: log2 p exchanges of the whole buffer. For tiny messages.

At step k every rank swaps its whole (partially reduced) buffer with the
rank whose number differs in bit k, and both reduce the pair. After step k
each rank holds the reduction over a block of 2^(k+1) ranks; after log2 p
steps, over all of them. p = 8::

    step 0 (mask 1)   0<->1  2<->3  4<->5  6<->7
    step 1 (mask 2)   0<->2  1<->3  4<->6  5<->7
    step 2 (mask 4)   0<->4  1<->5  2<->6  3<->7

    after step 0   ranks 0,1 hold x0+x1     2,3 hold x2+x3   4,5 hold x4+x5   6,7 hold x6+x7
    after step 1   ranks 0..3 hold x0+..+x3                  4..7 hold x4+..+x7
    after step 2   every rank holds x0+..+x7

Non-power-of-two p (the standard fold, as in ``rhd``). With q the largest
power of two <= p and rem = p - q, ranks below 2*rem pair up: odd rank 2i+1
sends its buffer to even rank 2i, which reduces it, takes core rank i and
goes on; the odd ranks sit out. Ranks from 2*rem on are core ranks r - rem.
At the end each even rank sends the result to its odd partner. p = 6::

    fold     1 -> 0, 3 -> 2                 core: 0 2 4 5  (core ranks 0 1 2 3)
    exchange 0, 1 on the 4 core ranks, as above
    unfold   0 -> 1, 2 -> 3

Steps: fold, exchange 0..log2 q - 1, unfold.

Bitwise identical results. Both partners of an exchange compute the same
pair, so they must compute it the same way. We do not rely on commutativity:
the kernels' Min/Max are not bitwise commutative (min(-0.0, +0.0) keeps the
first operand, min of two NaNs the second's payload) and neither is x86
addition of two NaNs (it keeps the first payload). Instead both partners compute ``lower (op) higher`` - the lower core
rank's data is always the destination operand. The higher rank therefore
reduces into its receive scratch and the two buffers trade roles, so no
extra copy is needed until (at most) one at the very end. Average's divide
is fused into the last exchange's reduction, identically on both partners.

Cost (alpha = latency per message, beta = seconds per byte sent, gamma =
seconds per byte reduced, n = bytes, q = p for a power of two)::

    T = log2 q alpha  +  log2 q n beta  +  log2 q n gamma
        + (p not a power of two)  2 alpha + 2 n beta + n gamma

The fewest latency terms of any algorithm here, but each rank sends
log2 p times the whole buffer: the choice for messages of a few KiB.
``segment_bytes`` is accepted for the common signature and unused:
segmenting a whole-buffer exchange would only add latency terms.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import kernels
from ..buffers import Workspace
from ..ops import Average, Op
from ..transport.base import Transport

__all__ = ["allreduce", "core_layout", "exchange_peers"]

TAG = 18


def core_layout(p: int, rank: int) -> tuple[int, int, int]:
    """The fold of ``p`` ranks onto a power-of-two core.

    Args:
        p: number of ranks.
        rank: this rank.

    Returns:
        ``(q, rem, core_rank)``: the core size (largest power of two <= p),
        the number of ranks folded away, and this rank's core rank, which is
        -1 for an odd rank below ``2 * rem`` (it sits out the exchanges).
    """
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    if rank < 2 * rem:
        return q, rem, rank // 2 if rank % 2 == 0 else -1
    return q, rem, rank - rem


def exchange_peers(p: int, rank: int) -> list[int]:
    """The real rank this rank exchanges with at each step of the core (empty if it sits out).

    Args:
        p: number of ranks.
        rank: this rank.

    Returns:
        One partner rank per exchange step, in step order.
    """
    q, rem, core = core_layout(p, rank)
    if core < 0:
        return []
    return [_real_rank(core ^ (1 << k), rem) for k in range(q.bit_length() - 1)]


def _real_rank(core_rank: int, rem: int) -> int:
    return 2 * core_rank if core_rank < rem else core_rank + rem


@lru_cache(maxsize=64)
def _plan(p: int, rank: int) -> tuple[int, int, tuple[tuple[int, bool], ...]]:
    """``(rem, core, steps)`` with one ``(peer, i_am_lower)`` per exchange, computed once per (p, rank):
    at 8 bytes the whole call costs a few microseconds, and this bookkeeping was a visible part."""
    q, rem, core = core_layout(p, rank)
    if core < 0:
        return rem, core, ()
    return rem, core, tuple((_real_rank(core ^ (1 << k), rem), core < core ^ (1 << k))
                            for k in range(q.bit_length() - 1))


def _reduce(dst: np.ndarray, src: np.ndarray, op: Op, last: bool, p: int) -> None:
    if last:
        kernels.reduce_finish_into(dst, src, op, p)   # final value of every element: fuse Average's / p
    else:
        kernels.reduce_into(dst, src, op)


def allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int = 0) -> None:
    """Reduce ``buf`` (contiguous, 1-D) in place across all ranks of ``comm``.

    Args:
        comm: the transport; every rank calls this with the same count, dtype and op.
        buf: this rank's contribution; holds the result on return.
        op: the reduction.
        workspace: where the one scratch buffer (``buf.nbytes``) comes from.
        segment_bytes: unused (whole-buffer exchanges); accepted for the common signature.
    """
    p, rank = comm.size, comm.rank
    if p == 1 or buf.size == 0:
        kernels.finish(buf, op, p)
        return
    rem, core, steps = _plan(p, rank)
    scratch = workspace.get("rd.scratch", buf.size, buf.dtype)

    # Fold: the first 2*rem ranks pair up so a power-of-two core remains.
    if rank < 2 * rem:
        comm.mark("fold", 0)
        if core < 0:
            comm.send(buf, rank - 1, TAG)                    # hand my buffer to my even partner
            comm.mark("unfold", 0)
            comm.recv(buf, rank - 1, TAG)                    # sit out; the result arrives finished
            return
        comm.recv(scratch, rank + 1, TAG)                    # the odd partner's buffer
        kernels.reduce_into(buf, scratch, op)                # only I compute this pair: order is free

    # Exchange: `mine` holds my partial result, `other` receives the partner's.
    mine, other = buf, scratch
    last = len(steps) - 1
    for k, (peer, lower) in enumerate(steps):                # peer: core rank core ^ 2^k, as a real rank
        comm.mark("exchange", k)
        comm.exchange(mine, other, peer, TAG)                # swap whole buffers with the partner
        if lower:
            _reduce(mine, other, op, k == last, p)           # I am lower: my data is dst
        elif (k < last or op != Average) and kernels.reduce_first_into(mine, other, op):
            pass                                             # mine = other (op) mine: no swap, no copy
        else:
            _reduce(other, mine, op, k == last, p)           # partner is lower: its data is dst
            mine, other = other, mine                        # the result now lives in the scratch
    if mine is not buf:
        kernels.copy_into(buf, mine)                         # at most one copy, after the last step

    # Unfold: return the result to the odd partner that sat out.
    if rank < 2 * rem:
        comm.mark("unfold", 0)
        comm.send(buf, rank + 1, TAG)
