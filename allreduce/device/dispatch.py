"""The allreduce of a device array: the checks, the per-communicator resources, and the path taken.

:func:`allreduce` validates the call, makes the input's GPU current, and
takes the first path that applies (see :mod:`allreduce.device`): p == 1,
direct (:mod:`.cuda_aware`), CUDA IPC (:mod:`.ipc`), else staging
(:mod:`.staging`). :class:`~.state._State` keeps what those paths reuse between
calls, one per communicator workspace: a stream per GPU, the pinned host
buffer, and the IPC scratch buffer and peer mappings.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

from numba import cuda

from ..config import ALGORITHM_NAMES
from ..errors import InvalidArgumentError
from ..kernels import cuda as dk
from ..ops import Op, as_op, check_dtype, dtype_code
from .arrays import _Input
from .cuda_aware import direct_mpi
from .ipc import ipc_allreduce
from .staging import DeviceStaging
from .state import _state

__all__ = ["allreduce"]


def allreduce(x: Any, op: Op, *, comm, algorithm: str | None, inplace: bool):
    """Reduce device array ``x`` over ``comm`` (a :class:`~allreduce.comm.Communicator`).

    Args:
        x: a device array (see :func:`~allreduce.device.is_device_array`), any shape, C-contiguous for numba.
        op: the reduction.
        comm: the communicator; its ``_run_allreduce`` runs the host algorithm on the staging copy.
        algorithm: as for ``Communicator.allreduce`` (None: the configured one).
        inplace: reduce into ``x`` (``allreduce_``) instead of a new array.

    Returns:
        ``x`` (in place) or a new array of the same type, shape, dtype and device.
    """
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
        reason = ipc_allreduce(work, inp.dtype, op, comm, state, stream, algorithm, inp.device_id) \
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


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)
