"""CUDA IPC: on one node, every rank reduces its slice straight from its peers' device buffers.

Enabled by ``cuda_ipc=True`` (``ALLREDUCE_CUDA_IPC=1``). Each rank exports a
scratch device buffer as an IPC handle (a new one only when the buffer must
grow), the ranks allgather the handles over the transport, and each maps its
peers' buffers, remapping only when a peer reallocated. Only the handles
cross host memory: :func:`ipc_allreduce` publishes, reduces its chunk from
every peer and gathers every finished chunk, device to device.

It needs one process per rank, all on one node, GPUs that can reach each
other, and numba's kernels (not the CuPy fallback or the simulator). When
any rank cannot, every rank learns the same reason and the caller falls back
to staging.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
from numba import cuda

from .. import partition
from ..config import ALGORITHM_NAMES
from ..kernels import cuda as dk
from ..ops import Op, dtype_code
from ..transport.base import Transport
from .state import _State

__all__ = ["ipc_allreduce"]


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


def ipc_allreduce(work, dtype: np.dtype, op: Op, comm, state: _State, stream, algorithm: str,
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
