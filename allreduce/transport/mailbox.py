"""Shared-memory mailboxes: the MPI transport's fast path for small symmetric swaps on one node.

A small message through MPI on one node is already a copy through shared
memory, but it pays for MPI's machinery on the way: request objects, tag
matching, a progress engine, and from 4 KiB on (Open MPI's ``sm`` eager
limit, header included) a rendezvous handshake. The latency algorithms
(``rd``, ``tree`` at p = 2, the engine's negotiation) spend their time in
exactly those small swaps, so the transport offers one more call,
:meth:`~allreduce.transport.base.Transport.exchange` (a swap with one peer,
which both sides call), and on one node runs it through a mailbox instead::

    rank i's region of the segment        one box per peer j (i -> j):
    +---------+---------+---------+        +--------+--------+--------------------+
    | box i>0 | box i>1 |   ...   |        |  seq   |  ack   | data (limit bytes) |
    +---------+---------+---------+        +--------+--------+--------------------+
                                            written  written   written by i,
                                            by i     by j      read by j

    put(buf, j):   wait until ack(i>j) == sent[j]    (j has read my last message)
                   copy buf into data(i>j); seq(i>j) = ++sent[j]
    take(buf, j):  wait until seq(j>i) == recvd[j] + 1
                   copy data(j>i) into buf;  ack(j>i) = ++recvd[j]

A message may carry a head: two integers written into the seq line before
seq moves (``put(buf, j, head)``), which the receiver reads first
(``peek``) and then takes or skips the data. The metadata check rides there
(:mod:`allreduce.algorithms.agree`): it costs no extra message.

One slot per direction, two counters each written by one side only: the
sender rewrites the slot only after the receiver has said it is done with
it, and the receiver reads only what the sender has said is complete. An
exchange is ``put`` then ``take`` on both sides, so neither waits for the
other's ``take`` before its own ``put``: no deadlock. Each counter has its
own cache line, so a spinning reader never shares a line with the writer's
data. On x86 stores are seen in program order and loads are not moved
ahead of loads, so the data is visible before the counter that announces
it; elsewhere ``MPI.Win.Sync`` fences every counter write and read.

Cost: one copy in, one copy out, two counter writes, and the wait for the
peer: ~0.8 us for 8 bytes and ~1.6 us for 4 KiB against ~1.5 us and ~5.3 us
for ``MPI_Sendrecv`` on the 2-core VM (``-np 2``, bound to cores, by hand).

Only messages of at most ``limit`` bytes (``LIMIT``, 32 KiB) take the
mailbox; larger ones, and every other call (send, recv, isend, irecv,
sendrecv), stay on MPI. Two copies (in and out) against Open MPI's one
(from 4 KiB on, the receiver reads the sender's buffer itself, after the
handshake) break even near 32 KiB: on the 2-core VM an 8 KiB swap took
2.0 us against 5.0 through MPI, 32 KiB 6.0 against 6.8, 64 KiB 11.4
against 9.7 (``docs/examples/mailbox_latency.py``, by hand). Each
direction of an exchange chooses by its own size, and both ends of that
direction see the same size, so both choose alike. The mailbox exists only
where every rank of the communicator shares one node and Open MPI may use
shared memory (not under ``--mca btl tcp,self``, not with
``ALLREDUCE_FAKE_NODE_SIZE``, which stand in for separate nodes;
``ALLREDUCE_SHM_P2P=0`` turns it off).

Waits are bounded like MPI's: a tight spin, then ``sched_yield`` (an
oversubscribed peer needs this core), then short sleeps, calling into MPI
now and then so a message still in flight on MPI progresses, and
``TransportTimeoutError`` naming the peer after ``timeout`` seconds.
"""
from __future__ import annotations

import os
import platform
import time

import numpy as np

from ..errors import TransportTimeoutError

__all__ = ["Mailbox", "LIMIT", "HEAD_WORDS"]

LIMIT = 32 << 10            #: largest message a box holds, up to 16 ranks on the node (then less)
_LINE = 64
HEAD_WORDS = 2              #: integers a message's head carries, beside the counter in its line
_SPINS = 2000               #: tight polls first: a peer on another core answers within microseconds
_YIELDS = 2000              #: then sched_yield: an oversubscribed peer needs this core
_SLEEP = 20e-6
_PROGRESS = 64              #: in the slow wait, call into MPI once every this many polls
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def _bytes(buf: np.ndarray) -> memoryview:
    try:
        return buf.data.cast("B")
    except (ValueError, TypeError):          # a dtype the buffer protocol cannot name (bfloat16)
        return buf.view(np.uint8).data


class Mailbox:
    """This rank's boxes on a shared segment of the communicator's ranks (see the module doc)."""

    def __init__(self, win, node, rank: int, size: int, limit: int, timeout: float, progress,
                 spins: int = _SPINS):
        self._win, self._node = win, node
        self.rank, self.size, self.limit, self.timeout = rank, size, limit, timeout
        self._progress = progress
        self._fence = None if _X86 else win.Sync
        crowded = size > (os.cpu_count() or 1)   # more ranks than cores: hand the core over soon
        self._spins = min(spins, 50) if crowded else spins
        self._yields = 20 if crowded else _YIELDS
        stride = 2 * _LINE + limit
        per_rank = size * stride
        regions = [np.frombuffer(win.Shared_query(j)[0], np.uint8, count=per_rank) for j in range(size)]

        def box(owner: int, peer: int):
            b = regions[owner][peer * stride:(peer + 1) * stride]
            return (memoryview(b[:_LINE]).cast("q"), memoryview(b[_LINE:2 * _LINE]).cast("q"),
                    memoryview(b[2 * _LINE:]))
        self._out = [box(rank, j) for j in range(size)]    # i -> j: I write seq and data
        self._in = [box(j, rank) for j in range(size)]     # j -> i: I write ack
        self._sent = [0] * size
        self._recvd = [0] * size

    @classmethod
    def create(cls, comm, *, timeout: float, limit: int | None = None, spins: int = _SPINS,
               alive=None) -> "Mailbox | None":
        """Build the mailboxes of ``comm`` (an mpi4py communicator; collective), or None where its
        ranks do not all share one node. ``alive``: a :class:`~allreduce.transport.liveness.Liveness`
        (``--elastic``): the slow wait then also raises ``PeerLostError`` when a peer died."""
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        size = comm.Get_size()
        if node.Get_size() != size or size < 2:
            node.Free()
            return None
        if limit is None:
            limit = LIMIT if size <= 16 else max(4 << 10, (512 << 10) // size)
        limit = -(-limit // _LINE) * _LINE
        win = MPI.Win.Allocate_shared(size * (2 * _LINE + limit), 1, comm=node)
        win.Lock_all(MPI.MODE_NOCHECK)           # one passive epoch: Win.Sync needs it
        rank = node.Get_rank()
        # All ranks on one node, split with one key: the node's ranks are the communicator's.
        box = cls(win, node, rank, size, limit, timeout, comm.Iprobe if alive is None else alive.progress, spins)
        for seq, _, _ in box._out:
            seq[0] = 0
        for _, ack, _ in box._in:
            ack[0] = 0
        node.Barrier()                           # every counter is zero before anyone reads one
        return box

    def put(self, buf: np.ndarray, peer: int, head: tuple[int, int] | None = None) -> None:
        """Send ``buf`` (contiguous, at most ``limit`` bytes) to ``peer``'s :meth:`take`.

        ``head``: two integers (int64) that travel in the counter's own cache line (the call's
        metadata check, :mod:`allreduce.algorithms.agree`): the peer reads them with
        :meth:`peek` before it decides to copy the data or :meth:`skip` it."""
        seq, ack, data = self._out[peer]
        sent = self._sent[peer]
        if ack[0] < sent:
            self._wait(ack, sent, peer, "send to")
        if head is not None:
            seq[1] = head[0]
            seq[2] = head[1]
        n = buf.nbytes
        if n:
            data[:n] = _bytes(buf)
        if self._fence is not None:
            self._fence()
        seq[0] = self._sent[peer] = sent + 1

    def take(self, buf: np.ndarray, peer: int) -> None:
        """Receive ``peer``'s next :meth:`put` into ``buf`` (exactly ``buf.nbytes`` bytes)."""
        seq, ack, data = self._in[peer]
        want = self._recvd[peer] + 1
        if seq[0] < want:
            self._wait(seq, want, peer, "receive from")
        if self._fence is not None:
            self._fence()
        n = buf.nbytes
        if n:
            _bytes(buf)[:] = data[:n]
        ack[0] = self._recvd[peer] = want

    def peek(self, peer: int) -> tuple[int, int]:
        """Wait for ``peer``'s next :meth:`put` and return its head, leaving the message in the
        box for :meth:`take` (no second wait) or :meth:`skip`."""
        seq = self._in[peer][0]
        want = self._recvd[peer] + 1
        if seq[0] < want:
            self._wait(seq, want, peer, "receive from")
        if self._fence is not None:
            self._fence()
        return seq[1], seq[2]

    def skip(self, peer: int) -> None:
        """Drop ``peer``'s message that :meth:`peek` saw, unread (its head told it is not wanted)."""
        want = self._recvd[peer] + 1
        self._in[peer][1][0] = self._recvd[peer] = want

    def swap_headed(self, buf: np.ndarray, out: np.ndarray, peer: int,
                    head: tuple[int, int] | None) -> tuple[int, int] | None:
        """``put(buf, peer, head)``, ``peek(peer)``, then ``take(out, peer)`` if the peer's head
        equals ``head``, else ``skip(peer)``; returns the peer's head. The same messages as
        those four calls, in one: the p = 2 exchange of the default call (a ~4 us call, of
        which the three extra calls and their lookups cost ~0.3 us). ``head`` None: no head
        (the check is off), ``put`` then ``take``; returns None."""
        seq, ack, data = self._out[peer]
        sent = self._sent[peer]
        if ack[0] < sent:
            self._wait(ack, sent, peer, "send to")
        if head is not None:
            seq[1] = head[0]
            seq[2] = head[1]
        n = buf.nbytes
        if n:
            data[:n] = _bytes(buf)
        fence = self._fence
        if fence is not None:
            fence()
        seq[0] = self._sent[peer] = sent + 1
        seq, ack, data = self._in[peer]
        want = self._recvd[peer] + 1
        if seq[0] < want:
            self._wait(seq, want, peer, "receive from")
        if fence is not None:
            fence()
        theirs = None if head is None else (seq[1], seq[2])
        if theirs == head:
            n = out.nbytes
            if n:
                _bytes(out)[:] = data[:n]
        ack[0] = self._recvd[peer] = want
        return theirs

    def _wait(self, counter, value: int, peer: int, what: str) -> None:
        fence = self._fence
        for _ in range(self._spins):
            if fence is not None:
                fence()
            if counter[0] >= value:
                return
        deadline = time.monotonic() + self.timeout
        polls = 0
        while True:
            if fence is not None:
                fence()
            if counter[0] >= value:
                return
            polls += 1
            if polls < self._yields:
                os.sched_yield()
            else:
                time.sleep(_SLEEP)
            if polls % _PROGRESS == 0:
                self._progress()                 # a message of this rank's still on MPI moves on
                if time.monotonic() > deadline:
                    raise TransportTimeoutError(
                        f"rank {self.rank}: no progress for {self.timeout:g} s waiting to {what} rank "
                        f"{peer} (shared-memory mailbox); that rank is stuck or not calling the same "
                        "collective (raise ALLREDUCE_TIMEOUT if it is just slow)")

    def close(self) -> None:
        """Free the segment (collective over the node, like every other MPI free)."""
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()
            self._node.Free()
            self._win = self._node = None
