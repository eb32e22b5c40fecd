"""The point-to-point interface every algorithm is written against.

A transport moves bytes between two ranks and nothing else: no reductions,
no collectives. Algorithms see only this interface, so the same ring code
runs over MPI between processes and over queues between threads.

Buffers are contiguous 1-D numpy arrays (any dtype); a transport sends their
bytes. Message order between one pair of ranks on one tag is FIFO, as in
MPI: the n-th receive posted from a peer matches the n-th send that peer made.

``exchange(sendbuf, recvbuf, peer)`` is the one call both sides must make
alike: a swap with one peer at the same step (recursive doubling's pairs,
both ranks at p = 2). It exists so a transport can carry it another way; the
MPI transport uses shared-memory mailboxes on one node
(:mod:`allreduce.transport.mailbox`).
"""
from __future__ import annotations

import abc
from typing import Protocol, Sequence

import numpy as np

__all__ = ["Request", "Transport", "wait_all"]


class Request(Protocol):
    """A pending nonblocking send or receive."""

    def wait(self) -> None:
        """Block until the transfer is complete; the buffer may then be reused."""


class Transport(abc.ABC):
    """Point-to-point messaging between ``size`` ranks. This rank is ``rank``."""

    rank: int
    size: int

    @abc.abstractmethod
    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``dest``. Do not modify ``buf`` until ``wait()``."""

    @abc.abstractmethod
    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        """Start receiving from ``source`` into ``buf`` (exactly ``buf.nbytes`` bytes)."""

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self.isend(buf, dest, tag).wait()

    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> None:
        self.irecv(buf, source, tag).wait()

    def sendrecv(self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int,
                 tag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once (no deadlock in a ring)."""
        recv = self.irecv(recvbuf, source, tag)
        send = self.isend(sendbuf, dest, tag)
        self.wait_all([recv, send])

    def exchange(self, sendbuf: np.ndarray, recvbuf: np.ndarray, peer: int, tag: int = 0) -> None:
        """Swap buffers with ``peer``, which makes the matching ``exchange`` call at the same step
        (recursive doubling's pairs, any pair at p = 2). It is :meth:`sendrecv` with one peer; a
        transport may carry it another way, as the MPI transport's shared-memory mailboxes do,
        so both sides must call ``exchange``, not one of them ``send``/``recv``."""
        self.sendrecv(sendbuf, peer, recvbuf, peer, tag)

    def swap(self, sendbuf: np.ndarray, recvbuf: np.ndarray, peer: int, tag: int = 0) -> None:
        """Send to and receive from ``peer`` at once where either side may be empty: an empty
        side is not posted at all, so the peer must compute the same sizes (halving-doubling's
        uneven halves, Adasum's). Always point-to-point, never a mailbox."""
        requests = []
        if recvbuf.size:
            requests.append(self.irecv(recvbuf, peer, tag))
        if sendbuf.size:
            requests.append(self.isend(sendbuf, peer, tag))
        if requests:
            self.wait_all(requests)

    def exchange_head(self, head: tuple[int, int], peer: int, tag: int) -> tuple[int, int]:
        """Swap two integers with ``peer``, which makes the matching call at the same step (the
        metadata check's messages: :mod:`allreduce.algorithms.agree`). Here an :meth:`exchange` of
        two int64 arrays; the MPI transport writes them into a mailbox's head instead."""
        mine = np.array(head, np.int64)
        theirs = np.empty_like(mine)
        self.exchange(mine, theirs, peer, tag)
        return tuple(theirs.tolist())

    def wait_all(self, requests: Sequence[Request]) -> None:
        for request in requests:
            request.wait()

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return only when every rank has entered the barrier."""

    def mark(self, phase: str, step: int) -> None:
        """An algorithm announces that it starts ``step`` of ``phase``.

        A no-op here. The recording transport of ``allreduce.explain`` and the
        engine's timeline override it to draw the steps.
        """

    def close(self) -> None:
        """Release what the transport holds. Idempotent."""


def wait_all(transport: Transport, requests: list) -> None:
    """Wait for ``requests`` and clear the list, so it can be reused without allocating."""
    if requests:
        transport.wait_all(requests)
        requests.clear()


WINDOW = 2
"""Messages in flight each way in :func:`send_recv_messages`, as the ring's pipeline depth."""


def send_recv_messages(transport: Transport, send: list, dest: int, recv: list, source: int, tag: int,
                       window: int = WINDOW) -> None:
    """Send the arrays ``send`` to ``dest`` and receive into ``recv`` from ``source``, in order,
    with at most ``window`` messages each way in flight.

    A window, not everything at once: on the 1 Gbit/s namespace cluster (2 ranks, MPI over TCP)
    a reduce-scatter + allgather of 22 MB, its 11 MB block posted at once, took 361 ms; in 256 KiB
    messages two at a time, 191 ms (the wire's bound: 176 ms). The first is the time of the two
    directions one after the other. The shaper is not the cause (``tc -s qdisc``: nothing
    dropped in either run); why MPI's TCP path serialises many large messages is not found.
    """
    for at in range(0, max(len(send), len(recv)), window):
        requests = [transport.irecv(a, source, tag) for a in recv[at:at + window]]
        requests += [transport.isend(a, dest, tag) for a in send[at:at + window]]
        wait_all(transport, requests)
