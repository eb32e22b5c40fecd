"""MPI transport: point-to-point over any mpi4py communicator.

Besides :mod:`allreduce.algorithms.native`, this is the only module that
calls mpi4py's data-moving functions. Every buffer goes out as raw bytes
(``MPI.BYTE``), so dtypes MPI has never heard of, such as bfloat16, travel
unchanged.

The transport works on its own duplicate of the communicator, so its
messages can never match a message the application sends on the original.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .base import Transport

__all__ = ["MPITransport"]


class _Request:
    __slots__ = ("raw",)

    def __init__(self, raw: MPI.Request):
        self.raw = raw

    def wait(self) -> None:
        self.raw.Wait()


def _bytes(buf: np.ndarray):
    # A contiguous 1-D view as bytes; a zero-size buffer is still a valid (empty) message.
    return [buf.reshape(-1).view(np.uint8), MPI.BYTE]


class MPITransport(Transport):
    """Point-to-point messaging over ``comm`` (default ``COMM_WORLD``)."""

    def __init__(self, comm: MPI.Comm | None = None, *, dup: bool = True):
        base = MPI.COMM_WORLD if comm is None else comm
        self.comm = base.Dup() if dup else base
        self._owned = dup
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def isend(self, buf, dest, tag=0):
        return _Request(self.comm.Isend(_bytes(buf), dest, tag))

    def irecv(self, buf, source, tag=0):
        return _Request(self.comm.Irecv(_bytes(buf), source, tag))

    def send(self, buf, dest, tag=0):
        self.comm.Send(_bytes(buf), dest, tag)

    def recv(self, buf, source, tag=0):
        self.comm.Recv(_bytes(buf), source, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        self.comm.Sendrecv(_bytes(sendbuf), dest, tag, _bytes(recvbuf), source, tag)

    def wait_all(self, requests):
        MPI.Request.Waitall([r.raw for r in requests])

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        if self._owned and self.comm != MPI.COMM_NULL:
            self.comm.Free()
            self._owned = False
