"""CUDA device arrays: recognising them, choosing the GPU, and moving their bytes.

:mod:`allreduce.buffers` decides host versus device (``is_device_array``)
and hands device arrays here. :func:`allreduce` takes one of four paths:

* **p == 1** (or nothing to reduce): only Average's divide, on the device.
* **direct**, with CUDA-aware MPI (:func:`cuda_aware_mpi`, or
  ``ALLREDUCE_CUDA_AWARE_MPI=1``), the MPI transport, algorithm ``auto`` or
  ``mpi`` and a dtype MPI reduces exactly (float32/64, int32/64, uint8): the buffer goes
  straight to ``MPI_Allreduce``; Average's divide runs on the device.
* **CUDA IPC** (``cuda_ipc=True`` / ``ALLREDUCE_CUDA_IPC=1``; all ranks on
  one node, one process each): every rank maps its peers' device buffers
  and reduces its slice straight from them (:func:`_ipc_allreduce`). If any
  rank cannot, all fall back to staging, with one warning naming why.
* **staging** (always available): copy the device buffer to a pinned host
  buffer in segments on a stream, run the host algorithm on the host copy,
  copy the result back in segments. The copies overlap the messages::

      stream   D2H seg0 | D2H seg1 | D2H seg2 | ...               H2D seg0 | seg1 ...
      host              send seg0 | send seg1 | send seg2 | ... (algorithm)

  A send of host segment k waits only for the event of D2H copy k, so the
  copy of k+1 runs while k is on the wire (:class:`DeviceStaging`).

Results come back on the input's device and as the input's type: CuPy in,
CuPy out; numba in, numba out; a TensorFlow GPU tensor (through DLPack and
CuPy) in, a TensorFlow tensor out. bfloat16 has no dtype in numba or CuPy:
wrap a ``uint16`` device array as ``Typed(x, ar.bfloat16)``.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pickle
import re
import shutil
import subprocess
import warnings
import weakref
from typing import Any

import numpy as np
from numba import cuda

from .errors import InvalidArgumentError
from .kernels import cuda as dk
from .ops import Op, check_dtype
from .transport.base import Transport

__all__ = ["Typed", "is_device_array", "num_devices", "choose_device", "select_device",
           "cuda_aware_mpi", "parse_ompi_info", "direct_mpi", "DeviceStaging", "StagedTransport", "allreduce"]


class Typed:
    """A device array whose elements are ``dtype`` (bfloat16 stored as ``uint16``, say)."""

    def __init__(self, array: Any, dtype):
        self.array, self.dtype = array, np.dtype(dtype)
        if self.dtype.itemsize != np.dtype(array.dtype).itemsize:
            raise InvalidArgumentError(f"Typed: {array.dtype} storage cannot hold {self.dtype}")
        self.shape, self.size = tuple(array.shape), int(np.prod(array.shape, dtype=np.int64))


def is_device_array(x: Any) -> bool:
    """True for CuPy/numba/torch CUDA arrays, simulator device arrays, ``Typed`` and TF GPU tensors."""
    if isinstance(x, Typed) or hasattr(x, "__cuda_array_interface__"):
        return True
    if dk.SIMULATED and type(x).__name__ == "FakeCUDAArray":
        return True
    return type(x).__module__.startswith("tensorflow") and "GPU" in str(getattr(x, "device", ""))


# -- choosing the GPU -------------------------------------------------------------------
def num_devices() -> int:
    """GPUs this process can see (0 without a driver)."""
    cp = dk._cupy()
    if cp is not None and not dk.SIMULATED:
        return cp.cuda.runtime.getDeviceCount()
    try:
        return len(cuda.gpus) if dk.SIMULATED or cuda.is_available() else 0
    except Exception:                                      # noqa: BLE001 - no driver: no GPU
        return 0


def choose_device(local_rank: int, *, override: int = -1, count: int | None = None) -> int:
    """``override`` if set (>= 0), else ``local_rank % count``: several ranks may share a GPU."""
    count = num_devices() if count is None else count
    if count <= 0:
        raise InvalidArgumentError("no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES)")
    if override >= 0:
        if override >= count:
            raise InvalidArgumentError(f"ALLREDUCE_DEVICE={override}, but only {count} GPU(s) are visible")
        return override
    return local_rank % count


def select_device(local_rank: int, *, override: int = -1) -> int:
    """Make ``choose_device(...)`` this thread's current GPU (numba and CuPy); return its id.

    Call it once at start-up, before allocating device arrays, e.g.
    ``ar.device.select_device(ar.local_rank(), override=ar.communicator().config.device)``.
    """
    dev = choose_device(local_rank, override=override)
    if not dk.SIMULATED:
        if cuda.is_available():                           # numba's driver: staging copies, kernels
            cuda.select_device(dev)
        cp = dk._cupy()
        if cp is not None:
            cp.cuda.Device(dev).use()
    return dev


# -- CUDA-aware MPI ---------------------------------------------------------------------
_OMPI_CUDA = re.compile(r"^mca:\w+:base:param:(?:mpi|opal)_built_with_cuda_support:value:(\w+)", re.M)


def parse_ompi_info(text: str) -> bool | None:
    """``ompi_info --parsable --all`` output -> built with CUDA support? (None: not stated)."""
    found = _OMPI_CUDA.findall(text)
    return None if not found else any(v.lower() == "true" for v in found)


def _query_mpix() -> bool | None:
    """``MPIX_Query_cuda_support()`` from the loaded libmpi (Open MPI >= 2, MPICH >= 4)."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if re.search(r"/libmpi\.so", line)}
        for path in sorted(libs):
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
            if fn is not None:
                return bool(fn())
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi(setting: str = "auto") -> bool:
    """Can MPI send from and receive into device memory? ``setting`` "1"/"0" forces the answer."""
    if setting in ("1", "0"):
        return setting == "1"
    answer = _query_mpix()
    if answer is not None:
        return answer
    from mpi4py import MPI                                 # only to name the library
    if "Open MPI" in MPI.Get_library_version() and shutil.which("ompi_info"):
        try:
            out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                                 text=True, timeout=20).stdout
            return bool(parse_ompi_info(out))
        except (OSError, subprocess.SubprocessError):
            return False
    return False


# -- staging through pinned host memory ---------------------------------------------------
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


# -- the user's array, and the result in the same form ------------------------------------
class _Input:
    """A device array as the library needs it: a flat contiguous work array, and the result maker."""

    def __init__(self, x: Any):
        self.original, self.dtype = x, None
        if isinstance(x, Typed):
            self.dtype, x = x.dtype, x.array
        module = type(x).__module__
        self.kind = ("cupy" if module.startswith("cupy") else "tensorflow" if module.startswith("tensorflow")
                     else "numba" if hasattr(x, "copy_to_host") else "cai")
        if self.kind == "tensorflow":
            cp = _require_cupy("a TensorFlow GPU tensor (it travels through DLPack into CuPy)")
            import tensorflow as tf
            x = cp.from_dlpack(tf.experimental.dlpack.to_dlpack(x))
        self.array = x
        self.dtype = np.dtype(self.dtype or x.dtype)
        self.shape = tuple(x.shape)
        self.device_id = 0 if dk.SIMULATED else (
            x.device.id if self.kind in ("cupy", "tensorflow") else cuda.get_current_device().id)

    def work(self, inplace: bool):
        """``(flat, result)``: a contiguous 1-D device array to reduce in place, and a function
        returning what the caller gets back after the reduction."""
        x, size = self.array, int(np.prod(self.shape, dtype=np.int64))
        if self.kind in ("cupy", "tensorflow"):
            cp = dk._cupy()
            out = x if inplace and x.flags.c_contiguous else cp.array(x, order="C", copy=True)
            if not inplace:
                return out.reshape(-1), lambda: self._wrap(out)
            if out is x:
                return out.reshape(-1), lambda: self.original
            return out.reshape(-1), lambda: (x.__setitem__(Ellipsis, out), self.original)[1]
        nb = dk.as_numba(x)
        if not nb.is_c_contiguous():
            raise InvalidArgumentError("a non-contiguous numba/CUDA array cannot be reduced; "
                                       "pass a C-contiguous array (or a CuPy array)")
        if inplace:
            return nb.reshape(size), lambda: self.original
        out = cuda.device_array(self.shape, dtype=nb.dtype)
        out.copy_to_device(nb)
        return out.reshape(size), lambda: self._wrap(out)

    def _wrap(self, out):
        """``out`` (same shape as the input) as the input's type."""
        if self.kind == "tensorflow":
            import tensorflow as tf
            out = tf.experimental.dlpack.from_dlpack(out.toDlpack())
        elif self.kind == "cai" and type(self.array).__module__.startswith("torch"):
            import torch
            out = torch.as_tensor(out, device=self.array.device)
        return Typed(out, self.dtype) if isinstance(self.original, Typed) else out

    def context(self):
        """The input's GPU as the current device, for numba and CuPy, while reducing."""
        stack = contextlib.ExitStack()
        if not dk.SIMULATED:
            stack.enter_context(cuda.gpus[self.device_id])
            if dk._cupy() is not None:
                stack.enter_context(dk._cupy().cuda.Device(self.device_id))
        return stack


def _require_cupy(what: str):
    cp = dk._cupy()
    if cp is None:
        raise InvalidArgumentError(f"{what} needs CuPy with a working GPU: pip install cupy-cuda12x")
    return cp


class _State:
    """Per-communicator device resources, kept between calls: stream, pinned buffer, IPC maps."""

    def __init__(self):
        self.streams: dict[int, Any] = {}
        self.pinned: np.ndarray | None = None
        self.scratch: dict[int, Any] = {}        # device -> (IPC-exported device buffer, handle bytes)
        self.peers: dict[int, tuple] = {}        # peer rank -> (handle bytes, IPC handle, mapped array)

    def stream(self, device_id: int):
        if device_id not in self.streams:
            self.streams[device_id] = cuda.stream()
        return self.streams[device_id]

    def host(self, nbytes: int) -> np.ndarray:
        """Pinned (page-locked) host bytes, grown in powers of two: DMA needs no bounce copy."""
        if self.pinned is None or self.pinned.nbytes < nbytes:
            self.pinned = cuda.pinned_array(1 << max(12, (nbytes - 1).bit_length()), np.uint8)
        return self.pinned[:nbytes]


_STATES: "weakref.WeakKeyDictionary[Any, _State]" = weakref.WeakKeyDictionary()


def _state(workspace) -> _State:
    if workspace not in _STATES:
        _STATES[workspace] = _State()
    return _STATES[workspace]


# -- the allreduce of a device array ----------------------------------------------------
def allreduce(x: Any, op: Op, *, comm, algorithm: str | None, inplace: bool):
    """Reduce device array ``x`` over ``comm`` (a :class:`~allreduce.comm.Communicator`).

    Args:
        x: a device array (see :func:`is_device_array`), any shape, C-contiguous for numba.
        op: the reduction.
        comm: the communicator; its ``_run_allreduce`` runs the host algorithm on the staging copy.
        algorithm: as for ``Communicator.allreduce`` (None: the configured one).
        inplace: reduce into ``x`` (``allreduce_``) instead of a new array.

    Returns:
        ``x`` (in place) or a new array of the same type, shape, dtype and device.
    """
    from .config import ALGORITHM_NAMES
    from .ops import as_op, dtype_code
    op = as_op(op)
    inp = _Input(x)
    check_dtype(inp.dtype, op)
    algorithm = comm.config.algorithm if algorithm is None else algorithm
    if algorithm not in ALGORITHM_NAMES:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHM_NAMES)}")
    if inplace and inp.kind == "tensorflow":
        raise InvalidArgumentError("TensorFlow tensors are immutable; use allreduce(), which returns one")
    state = _state(comm.workspace)
    with inp.context():
        flat, result = inp.work(inplace)
        work = dk.as_numba(flat)
        stream = state.stream(inp.device_id)
        cuda.synchronize()                        # the input may have been written on any stream
        if comm.size == 1 or work.size == 0:
            comm.check_agreement("allreduce", count=work.size, dtype=dtype_code(inp.dtype), op=int(op),
                                 algorithm=ALGORITHM_NAMES.index(algorithm))
            dk.finish(work, op, comm.size, dtype=inp.dtype, stream=stream)
            stream.synchronize()
            return result()
        if direct_mpi(comm.config, comm.transport, inp.dtype, algorithm):
            # CUDA-aware MPI reads and writes device memory itself: MPI_Allreduce on the buffer.
            comm._run_allreduce(work, Op.SUM if op == Op.AVERAGE else op, "mpi")
            dk.finish(work, op, comm.size, dtype=inp.dtype, stream=stream)
            stream.synchronize()
            return result()
        reason = _ipc_allreduce(work, inp.dtype, op, comm, state, stream, algorithm, inp.device_id) \
            if comm.config.cuda_ipc else "off"
        if reason is not None:
            if reason != "off":
                _warn_once(f"CUDA IPC allreduce unavailable ({reason}); staging through host memory")
            host = state.host(work.size * inp.dtype.itemsize).view(inp.dtype)
            staging = DeviceStaging(work, host, segment_bytes=comm.config.segment_bytes, stream=stream)
            staging.download()
            comm._run_allreduce(host, op, algorithm, transport=staging.transport(comm.transport))
            staging.upload()
    return result()


_MPI_REDUCES = ("float32", "float64", "int32", "int64", "uint8")   # not fp16/bf16; int8: Open MPI saturates


def direct_mpi(config, transport: Transport, dtype: np.dtype, algorithm: str) -> bool:
    """Hand the device buffer straight to ``MPI_Allreduce``? Only with CUDA-aware MPI, the MPI
    transport, ``algorithm`` "auto" or "mpi", and a dtype MPI reduces exactly (``_MPI_REDUCES``)."""
    return (algorithm in ("auto", "mpi") and np.dtype(dtype).name in _MPI_REDUCES
            and type(getattr(transport, "comm", None)).__module__.startswith("mpi4py")
            and cuda_aware_mpi(config.cuda_aware_mpi))


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


# -- CUDA IPC: one node, reduce straight from the peers' device buffers ---------------------
def _allgather_bytes(transport: Transport, payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order: lengths first, then bytes, by shifted pairs."""
    p, me = transport.size, transport.rank
    out = [b""] * p
    out[me] = payload
    mine = np.frombuffer(payload, np.uint8)
    for shift in range(1, p):
        dest, source = (me + shift) % p, (me - shift) % p
        length = np.empty(1, np.int64)
        transport.sendrecv(np.array([mine.size], np.int64), dest, length, source, tag=29)
        data = np.empty(int(length[0]), np.uint8)
        transport.sendrecv(mine, dest, data, source, tag=29)
        out[source] = data.tobytes()
    return out


def _open_peer(state: _State, rank: int, handle: bytes):
    """Rank ``rank``'s scratch buffer mapped here; remapped only when the peer reallocated it."""
    known = state.peers.get(rank)
    if known is not None and known[0] == handle:
        return known[2]
    if known is not None:
        known[1].close()                                    # the peer freed that buffer
    ipch = pickle.loads(handle)
    inner = getattr(ipch, "_ipc_handle", None)              # numba's IpcHandle
    if inner is not None and not inner.can_access_peer(cuda.current_context()):
        # numba would "stage" it: a one-time copy, stale on the next call. Refuse instead.
        raise RuntimeError("its GPU is not peer-accessible from this one")
    state.peers[rank] = (handle, ipch, ipch.open())
    return state.peers[rank][2]


def _ipc_allreduce(work, dtype: np.dtype, op: Op, comm, state: _State, stream, algorithm: str,
                   device_id: int) -> str | None:
    """Reduce ``work`` (numba device array) over the node through CUDA IPC.

    Steps (each ends with a stream sync and a barrier, so no rank reads a peer's
    scratch before it is written or overwrites it while a peer still reads):

        publish   copy my input into my IPC-exported scratch buffer
        reduce    for my chunk r (partition.chunks): scratch_me[r] (op)= scratch_j[r], all j != me
        gather    work[j-th chunk] = scratch_j[j-th chunk], for every rank j

    Each element is reduced by one rank only, so results are bitwise identical.
    Returns None when done, else the reason (the same on every rank) to fall back.
    """
    from . import partition
    from .config import ALGORITHM_NAMES
    from .ops import dtype_code
    reason = ("the CUDA simulator has no IPC" if dk.SIMULATED else
              "numba cannot compile CUDA kernels here" if dk.backend() != "numba" else
              "ranks span several nodes" if comm.local_size != comm.size else "")
    transport, nbytes = comm.transport, work.size * dtype.itemsize
    scratch, handle = state.scratch.get(device_id, (None, b""))
    if not reason:
        try:
            if scratch is None or scratch.size < nbytes:
                scratch = cuda.device_array(1 << max(12, (nbytes - 1).bit_length()), np.uint8)
                handle = pickle.dumps(scratch.get_ipc_handle())
                state.scratch[device_id] = (scratch, handle)
        except Exception as exc:                            # noqa: BLE001 - reported, then fall back
            reason = f"exporting an IPC handle failed: {exc}"
    comm.check_agreement("allreduce", count=work.size, dtype=dtype_code(dtype), op=int(op),
                         algorithm=ALGORITHM_NAMES.index(algorithm))
    gathered = [pickle.loads(b) for b in _allgather_bytes(transport, pickle.dumps(
        (reason, os.getpid(), handle if not reason else b"")))]
    reasons = sorted({why for why, _, _ in gathered if why})
    if not reasons and len({pid for _, pid, _ in gathered}) < comm.size:
        reasons = ["ranks share a process (thread transport); IPC needs one process per rank"]
    if reasons:
        return "; ".join(reasons)
    peers, failed = {}, ""
    for r, (_, _, h) in enumerate(gathered):
        if r != comm.rank:
            try:
                peers[r] = _open_peer(state, r, h)
            except Exception as exc:                        # noqa: BLE001 - agreed on below
                failed = f"rank {comm.rank} cannot map rank {r}'s buffer: {exc}"
    failures = [f for f in _allgather_bytes(transport, failed.encode()) if f]
    if failures:
        return "; ".join(f.decode() for f in failures)
    mine = scratch[:nbytes].view(work.dtype)                # work's dtype: bfloat16 travels as uint16
    peers = {r: a[:nbytes].view(work.dtype) for r, a in peers.items()}
    peers[comm.rank] = mine
    mine.copy_to_device(work, stream=stream)                # publish
    stream.synchronize()
    transport.barrier()
    chunks = partition.chunks(work.size, comm.size)
    off, n = chunks[comm.rank]
    others = [r for r in range(comm.size) if r != comm.rank]
    for i, r in enumerate(others):                          # reduce my chunk from every peer
        last = i == len(others) - 1
        dst, src = mine[off:off + n], peers[r][off:off + n]
        (dk.reduce_finish_into(dst, src, op, comm.size, dtype=dtype, stream=stream) if last
         else dk.reduce_into(dst, src, op, dtype=dtype, stream=stream))
    stream.synchronize()
    transport.barrier()
    for r, (o, k) in enumerate(chunks):                     # gather every finished chunk
        if k:
            work[o:o + k].copy_to_device(peers[r][o:o + k], stream=stream)
    stream.synchronize()
    transport.barrier()                                     # scratch may be reused after this
    return None
