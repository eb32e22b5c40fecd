"""``mpi``: the MPI library's own ``MPI_Allreduce``, as reference and as a peer.

Not an algorithm of ours: Open MPI (or MPICH) picks its own internally. It
is here so every test and benchmark can compare against it in the same run.

MPI has no float16 or bfloat16 type, so those travel as 2-byte integers
(``MPI.UINT16_T``) combined by a user-defined op that calls our half-float
kernel. int8 takes the same route: Open MPI 5.0's vectorised int8 sum
saturates in its SIMD body but wraps in its scalar tail (3 ranks x 50 gave
127 for the first elements of a 1000-element vector and -106 for the last),
so the same call could return two different answers for one input.
Average is MPI's sum followed by ``kernels.finish``. bool travels as
``MPI.C_BOOL`` with the logical ops (Sum and Max ``MPI_LOR``, Min and
Product ``MPI_LAND``): MPI defines no arithmetic on its logical type.

Cost: whatever the library does; ``select`` fits it like any other.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..buffers import Workspace
from ..ops import Average, Op, Sum, bfloat16
from ..transport.base import Transport
from ..transport.mpi import MPI   # mpi4py's MPI, initialised with the transport's Open MPI settings
from ..transport.liveness import raise_if_lost

__all__ = ["allreduce"]

_MPI_OPS = {Op.SUM: MPI.SUM, Op.AVERAGE: MPI.SUM, Op.MIN: MPI.MIN, Op.MAX: MPI.MAX, Op.PRODUCT: MPI.PROD}
_BOOL_OPS = {Op.SUM: MPI.LOR, Op.MAX: MPI.LOR, Op.MIN: MPI.LAND, Op.PRODUCT: MPI.LAND}
_BOOL = np.dtype(np.bool_)
_HALF_OPS: dict[tuple[str, Op], MPI.Op] = {}


# dtype -> (the MPI datatype its bytes travel as, the numpy view matching it). Keyed by the dtype
# object: ``dtype.name`` is computed in Python and costs ~5 us, more than MPI_Allreduce of 8 bytes.
_USER_OP_DTYPES = {np.dtype(np.float16): (MPI.UINT16_T, np.uint16), bfloat16: (MPI.UINT16_T, np.uint16),
                   np.dtype(np.int8): (MPI.INT8_T, np.int8)}


def _user_op(dtype: np.dtype, op: Op) -> MPI.Op:
    """A commutative MPI user op that reduces ``dtype`` with our own kernel."""
    key = (dtype.name, op)
    if key not in _HALF_OPS:
        code = Sum if op == Average else op

        def reduce(inbuf, inoutbuf, datatype):
            src = np.frombuffer(inbuf, dtype=dtype)
            dst = np.frombuffer(inoutbuf, dtype=dtype)
            kernels.reduce_into(dst, src, code)

        _HALF_OPS[key] = MPI.Op.Create(reduce, commute=True)
    return _HALF_OPS[key]


def allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int = 0) -> None:
    """In-place ``MPI_Allreduce`` of ``buf`` over the transport's communicator."""
    mpi_comm = getattr(comm, "comm", None)
    if not isinstance(mpi_comm, MPI.Comm):
        raise ValueError("algorithm 'mpi' needs the MPI transport; the in-process transport "
                         "has no MPI communicator (use ring, tree, rhd or rd)")
    if buf.size == 0:
        return
    carrier = _USER_OP_DTYPES.get(buf.dtype)
    try:
        if carrier is not None:
            datatype, view = carrier
            mpi_comm.Allreduce(MPI.IN_PLACE, [buf.view(view), datatype], op=_user_op(buf.dtype, op))
        elif buf.dtype is _BOOL or buf.dtype == _BOOL:
            mpi_comm.Allreduce(MPI.IN_PLACE, [buf, MPI.C_BOOL], op=_BOOL_OPS[op])
        else:
            mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=_MPI_OPS[op])
    except MPI.Exception as exc:       # ULFM (--elastic): a rank died during the call
        raise_if_lost(exc, mpi_comm, comm.rank, "was in MPI_Allreduce")
        raise
    kernels.finish(buf, op, comm.size)
