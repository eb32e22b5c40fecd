"""The metadata check, carried in messages: does every rank make the same call?

A collective whose ranks disagree (another count, dtype, op, algorithm or
root) deadlocks or returns garbage. So every checked call turns its metadata
into a *head* of two integers and every rank learns, before any result is
used, whether all heads were equal::

    fields   count, dtype, op, algorithm, root, shared offset, call number
    h        a 62-bit hash of the fields (Python's tuple hash: the same on every rank)
    head     (h, -h)
    merge    elementwise max:  after merging every rank's head, (max h, -min h)
    agrees   max h == min h,  i.e.  head[0] == -head[1]

Heads travel along recursive doubling's pairs (``rd``'s schedule), each
partner merging the other's, so after log2 p swaps every rank holds the
merge over all ranks: every rank sees a mismatch, or none does. p = 4::

    step 0   0<->1  2<->3         heads merged over {0,1} and {2,3}
    step 1   0<->2  1<->3         over {0,1,2,3}

Not a power of two: pairs (2i, 2i+1) below 2*rem swap first (fold) and
again at the end (unfold), so the odd ranks that sit out the core learn the
result too. On a mismatch the communicator gathers the fields themselves to
name every rank's value (``comm.py``); that costs an allgather, but only then.

Vehicles, cheapest first:

* ``rd`` on the MPI transport's mailbox (one node, a power of two ranks, a
  message within the mailbox's limit): the head rides in the counter line of
  the data message itself (:func:`rd_carrying`): no extra message at all.
  The receiver reads the head first and copies the data only while the
  merged heads agree, so ranks whose counts differ never read a wrong-sized
  message; from a mismatch on, only heads travel.
* every other algorithm (native ``MPI_Allreduce`` included, which sends no
  message of ours): :func:`agree` first, heads only: on the mailbox the two
  integers ride in a message with no data (~0.3 us a swap at -np 2), else an
  exchange of two int64s.
* ``shm`` on registered buffers also compares offset, count and dtype in its
  flag line (``shm.zero_copy``), which catches slices that differ where the
  check is off.

Both vehicles keep the same schedule, so a rank carrying heads in data
messages pairs with a rank sending heads alone (their sizes differ, so one
fits the mailbox and the other does not): both see the mismatch.

Cost: log2 p head swaps, or nothing beyond rd's own exchanges. A hash
collision (2^-62 per pair of differing calls) would let a mismatch through.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..ops import Average
from ..transport.base import Transport
from . import rd

__all__ = ["head", "agrees", "agree", "carries", "rd_carrying", "pair", "TAG", "WORDS"]

TAG = 19
WORDS = 2                       #: integers in a head
_MASK = (1 << 62) - 1           # -h must fit an int64
_EMPTY = np.empty(0, np.uint8)  # after a mismatch only heads travel


def head(fields: tuple[int, ...]) -> tuple[int, int]:
    """The head of a call whose metadata is ``fields`` (a tuple of ints, the same order on every rank)."""
    h = hash(fields) & _MASK
    return h, -h


def agrees(merged: tuple[int, ...]) -> bool:
    """True if every head merged into ``merged`` was equal."""
    return merged[0] == -merged[1]


def _merge(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int]:
    return (a[0] if a[0] >= b[0] else b[0]), (a[1] if a[1] >= b[1] else b[1])


def agree(comm: Transport, mine: tuple[int, int]) -> tuple[int, int]:
    """Swap heads along rd's schedule (heads only); return the merge over every rank."""
    p, rank = comm.size, comm.rank
    if p == 2:
        return _merge(mine, comm.exchange_head(mine, 1 - rank, TAG))
    rem, core, steps = rd._plan(p, rank)
    merged = mine
    if rank < 2 * rem:                          # fold: 2i and 2i+1 swap
        merged = _merge(merged, comm.exchange_head(merged, rank ^ 1, TAG))
    for peer, _ in steps:                       # the core's exchanges (none for an odd rank that folded)
        merged = _merge(merged, comm.exchange_head(merged, peer, TAG))
    if rank < 2 * rem:                          # unfold: the odd rank learns the core's result
        merged = _merge(merged, comm.exchange_head(merged, rank ^ 1, TAG))
    return merged


def carries(comm: Transport, buf: np.ndarray, src: np.ndarray | None) -> bool:
    """Can :func:`rd_carrying` run this call? A mailbox, a power of two ranks, ``buf`` within the
    mailbox's limit, and out of place (``src``) or p = 2: a mismatch found at a later step must
    not leave a partial sum in the caller's own array."""
    box = getattr(comm, "mailbox", None)
    p = comm.size
    return (box is not None and buf.nbytes <= box.limit and buf.size > 0 and p & (p - 1) == 0
            and (src is not None or p == 2))


def rd_carrying(comm: Transport, buf: np.ndarray, op, mine: tuple[int, int], *, workspace,
                src: np.ndarray | None = None) -> tuple[int, int]:
    """``rd`` with this call's head in every exchange, through the mailbox; returns the merged head.

    The data is reduced only while the heads merged so far agree; if they end up disagreeing,
    ``buf`` holds nothing of use (the caller raises). ``src``: out of place, read the input there
    (the first exchange sends it straight from ``src``: no copy into ``buf`` first).
    """
    if comm.size == 2:
        return pair(comm.mailbox, comm.rank, buf, op, mine, workspace, src)
    box, p = comm.mailbox, comm.size
    _, _, steps = rd._plan(p, comm.rank)
    scratch = workspace.get("rd.scratch", buf.size, buf.dtype)
    merged = mine
    data, other = (buf if src is None else src), scratch    # src is never written
    last = len(steps) - 1
    for k, (peer, lower) in enumerate(steps):
        comm.mark("exchange", k)
        box.put(data, peer, merged)                          # my partial result, headed
        merged = _merge(merged, box.peek(peer))
        if merged[0] != -merged[1]:                          # someone's call differs: heads only from here
            box.skip(peer)
            data = _EMPTY
            continue
        finish = k == last
        if data is src:                                      # out of place, first step: theirs into buf
            box.take(buf, peer)
            data, other = _first(buf, src, scratch, op, lower, finish, p)
            continue
        box.take(other, peer)
        if lower:
            rd._reduce(data, other, op, finish, p)           # I am lower: my data is dst
        elif (not finish or op != Average) and kernels.reduce_first_into(data, other, op):
            pass
        else:
            rd._reduce(other, data, op, finish, p)           # partner is lower: its data is dst
            data, other = other, data
    if data is not buf and data is not _EMPTY:
        kernels.copy_into(buf, data)
    return merged


def _first(buf, src, scratch, op, lower: bool, finish: bool, p: int):
    """Out of place, the first exchange: the partner's data is in ``buf``, mine in ``src``; reduce
    (lower rank's data first) and return ``(data, other)``: where the result is, and the spare."""
    if not lower:
        rd._reduce(buf, src, op, finish, p)                  # buf = theirs (op) mine
        return buf, scratch
    if (not finish or op != Average) and kernels.reduce_first_into(buf, src, op):
        return buf, scratch                                  # buf = mine (op) theirs
    kernels.copy_into(scratch, src)
    rd._reduce(scratch, buf, op, finish, p)
    return scratch, buf


def pair(box, rank: int, buf: np.ndarray, op, mine: tuple[int, int] | None, workspace,
         src: np.ndarray | None = None) -> tuple[int, int] | None:
    """:func:`rd_carrying` at p = 2 on the mailbox ``box`` (the communicator's default call comes
    straight here): one headed swap, and the heads agree exactly when they are equal. Rank 0's
    data is the first operand on both ranks (the same bits). Returns the merged head. ``mine``
    None: the check is off, the swap carries data alone (``rd``'s messages at p = 2); returns None."""
    peer = 1 - rank
    if src is not None and (rank == 1 or (op != Average and kernels.has_first(op, buf.dtype))):
        theirs = box.swap_headed(src, buf, peer, mine)       # theirs lands in buf
        if theirs != mine:
            return _merge(mine, theirs)
        if rank == 1:
            kernels.reduce_finish_into(buf, src, op, 2)      # buf = theirs (op) mine
        else:
            kernels.reduce_first_into(buf, src, op)          # buf = mine (op) theirs
        return mine
    scratch = workspace.get("rd.scratch", buf.size, buf.dtype)
    theirs = box.swap_headed(buf if src is None else src, scratch, peer, mine)
    if theirs != mine:
        return _merge(mine, theirs)
    if src is not None:                                      # rank 0, out of place: Min, Max, Average,
        kernels.copy_into(buf, src)                          # 16-bit floats
    if rank == 0:
        rd._reduce(buf, scratch, op, True, 2)                # buf = mine (op) theirs
    elif op != Average and kernels.reduce_first_into(buf, scratch, op):
        pass                                                 # buf = theirs (op) mine
    else:
        rd._reduce(scratch, buf, op, True, 2)
        kernels.copy_into(buf, scratch)
    return mine
