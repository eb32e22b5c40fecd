"""Staging through pinned host memory, with the copies overlapping the messages.

The path every device array can take: copy the device buffer to a host
buffer in segments on a stream, run the host algorithm on the host copy,
copy the result back in segments::

    stream   D2H seg0 | D2H seg1 | D2H seg2 | ...               H2D seg0 | seg1 ...
    host              send seg0 | send seg1 | send seg2 | ... (algorithm)

A send of host segment k waits only for the event of D2H copy k, so the copy
of k+1 runs while k is on the wire. :class:`DeviceStaging` owns the copies
and their events; :class:`StagedTransport` wraps the algorithm's transport
so that nothing touches a segment before its copy has landed.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..errors import InvalidArgumentError
from ..kernels import cuda as dk
from ..transport.base import Transport

__all__ = ["DeviceStaging", "StagedTransport"]


class DeviceStaging:
    """Copies one device buffer to a host buffer in segments on a stream, and back.

    ``download()`` queues every D2H copy at once, with one event per segment.
    ``wait_range(off, n)`` then waits only for the segments covering
    ``[off, off+n)``: a send can start while later segments are still copying.
    ``log`` records what happened, in order (the tests read it):
    ``("d2h", k)`` queued, ``("ready", k)`` waited for, ``("send", off, n)``,
    ``("recv", off, n)``, ``("h2d", k)``.
    """

    def __init__(self, device, host: np.ndarray, *, segment_bytes: int, stream=0):
        if host.nbytes != device.size * np.dtype(device.dtype).itemsize:
            raise InvalidArgumentError(f"staging buffer of {host.nbytes} bytes for a device buffer of "
                                       f"{device.size} x {device.dtype}")
        self.device, self.host, self.stream = device, host, stream
        self._host_raw = host.view(device.dtype)           # bfloat16 on the host is uint16 on the device
        step = max(1, segment_bytes // max(1, host.itemsize))
        self.segments = [(off, min(step, host.size - off)) for off in range(0, host.size, step)]
        self.ready = [False] * len(self.segments)
        self._events: list = [None] * len(self.segments)
        self._step = step
        self._base = host.__array_interface__["data"][0]
        self.log: list[tuple] = []

    def download(self) -> None:
        """Queue the D2H copy of every segment on the stream; return at once."""
        for k, (off, n) in enumerate(self.segments):
            self.device[off:off + n].copy_to_host(self._host_raw[off:off + n], stream=self.stream)
            self._events[k] = event = cuda.event() if dk.SIMULATED else cuda.event(timing=False)
            event.record(self.stream)
            self.log.append(("d2h", k))

    def locate(self, buf: np.ndarray) -> tuple[int, int] | None:
        """``(offset, count)`` of ``buf`` inside the host buffer, or None if it lies elsewhere."""
        start = buf.__array_interface__["data"][0] - self._base
        if buf.dtype != self.host.dtype or not 0 <= start < self.host.nbytes:
            return None
        return start // self.host.itemsize, buf.size

    def wait_range(self, off: int, n: int) -> None:
        """Block until the D2H copies of the segments covering ``[off, off+n)`` are done."""
        if n <= 0:
            return
        for k in range(off // self._step, min(len(self.segments), (off + n - 1) // self._step + 1)):
            if not self.ready[k]:
                self._events[k].synchronize()
                self.ready[k] = True
                self.log.append(("ready", k))

    def wait_all(self) -> None:
        self.wait_range(0, self.host.size)

    def upload(self) -> None:
        """Copy the host buffer back in segments on the stream, then synchronise the stream."""
        self.wait_all()
        for k, (off, n) in enumerate(self.segments):
            self.device[off:off + n].copy_to_device(self._host_raw[off:off + n], stream=self.stream)
            self.log.append(("h2d", k))
        self.stream.synchronize() if self.stream else cuda.synchronize()

    def transport(self, inner: Transport) -> "StagedTransport":
        return StagedTransport(inner, self)


class _StagedRecv:
    __slots__ = ("inner", "staging")

    def __init__(self, inner, staging: DeviceStaging):
        self.inner, self.staging = inner, staging

    def wait(self) -> None:
        self.inner.wait()
        self.staging.wait_all()       # what arrived is reduced next, maybe into any segment


class StagedTransport(Transport):
    """``inner``, made safe for an algorithm running on a staging buffer still being filled.

    * a send from the staging buffer first waits for the D2H copies it covers;
    * a receive into it first waits for them too (else a late copy would overwrite it);
    * a completed receive waits for every copy, because an algorithm reduces
      received data into its buffer right after (no reduction without a receive).

    The contract this relies on, true of every algorithm here: an algorithm touches
    its buffer only by sending it, receiving into it, or after a receive completed.
    ``send``, ``recv`` and ``sendrecv`` are the base class's, built on these.
    """

    def __init__(self, inner: Transport, staging: DeviceStaging):
        self.inner, self.staging = inner, staging
        self.rank, self.size = inner.rank, inner.size

    def _guard(self, buf: np.ndarray, what: str) -> None:
        where = self.staging.locate(buf)
        if where is not None:
            self.staging.wait_range(*where)
            self.staging.log.append((what,) + where)

    def isend(self, buf, dest, tag=0):
        self._guard(buf, "send")
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self._guard(buf, "recv")
        return _StagedRecv(self.inner.irecv(buf, source, tag), self.staging)

    def wait_all(self, requests):
        self.inner.wait_all([r.inner if isinstance(r, _StagedRecv) else r for r in requests])
        if any(isinstance(r, _StagedRecv) for r in requests):
            self.staging.wait_all()

    def barrier(self) -> None:
        self.inner.barrier()

    def mark(self, phase: str, step: int) -> None:
        self.inner.mark(phase, step)

    def __getattr__(self, name: str):
        # An algorithm that reaches past the point-to-point interface (``mpi``'s
        # communicator, ``shm``'s shared segment) reads the whole buffer: finish copying first.
        self.staging.wait_all()
        return getattr(self.inner, name)
