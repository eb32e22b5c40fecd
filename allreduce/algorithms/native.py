"""``mpi``: the MPI library's own ``MPI_Allreduce``, as reference and as a peer.

Not an algorithm of ours: Open MPI (or MPICH) picks its own internally. It
is here so every test and benchmark can compare against it in the same run.

MPI has no float16 or bfloat16 type, so those travel as 2-byte integers
(``MPI.UINT16_T``) combined by a user-defined op that calls our half-float
kernel. int8 takes the same route: Open MPI 5.0's vectorised int8 sum
saturates in its SIMD body but wraps in its scalar tail (3 ranks x 50 gave
127 for the first elements of a 1000-element vector and -106 for the last),
so the same call could return two different answers for one input. uint8, int16 and uint16 likewise:
their sums saturate there (uint8 229 + 229 gave 255 for the first elements of a 17-element vector
at -np 2, where C, numpy and every algorithm of ours wrap to 202; found by Horovod's process-set
test at -np 3; int16 and uint16 near their maximum saturated at 17, 1000 and 5000 elements, -np 2
and 3), so all four take the user op. Wider integers wrap in Open MPI as in C (same check).
Average is MPI's sum followed by ``kernels.finish``. bool travels as
``MPI.C_BOOL`` with the logical ops (Sum and Max ``MPI_LOR``, Min and
Product ``MPI_LAND``): MPI defines no arithmetic on its logical type.

Under ``--elastic`` (Open MPI's ULFM over its tcp BTL) the call is cut into
pieces of at most ``ELASTIC_PIECE_BYTES`` (60 KiB), so every message MPI's
allreduce sends stays under the tcp BTL's eager limit (64 KiB). A message
above it goes as a rendezvous; if its sender dies while it waits unmatched,
Open MPI 5.0.11 deadlocks the receiver inside MPI (the tcp receive path NACKs
it over the endpoint whose lock it holds: ``allreduce/elastic/watchdog.py``).
Eager messages are dropped silently instead. ``ELASTIC_KILLS=0@2:rhd,3@5:mpi``
at -np 4 (``tests/mpi/elastic_train.py``) hung 2 times in 25 runs before, 0 in 50 after
(docs/11). Cost: the pieces go as MPI_Iallreduce calls, all in flight together,
then one MPI_Waitall: 0.6-1.0x the time of one MPI_Allreduce at 512 KiB-4 MiB
(-np 3 --elastic, one run on the loaded 2-core VM; blocking pieces were 1.2-1.3x).

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
ELASTIC_PIECE_BYTES = 60 << 10   #: --elastic: the most bytes one MPI_Allreduce call carries


# dtype -> (the MPI datatype its bytes travel as, the numpy view matching it). Keyed by the dtype
# object: ``dtype.name`` is computed in Python and costs ~5 us, more than MPI_Allreduce of 8 bytes.
_USER_OP_DTYPES = {np.dtype(np.float16): (MPI.UINT16_T, np.uint16), bfloat16: (MPI.UINT16_T, np.uint16),
                   np.dtype(np.int8): (MPI.INT8_T, np.int8), np.dtype(np.uint8): (MPI.UINT8_T, np.uint8),
                   np.dtype(np.int16): (MPI.INT16_T, np.int16), np.dtype(np.uint16): (MPI.UINT16_T, np.uint16)}


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
    try:
        if getattr(comm, "liveness", None) is None:
            _allreduce(mpi_comm, buf, op)
        else:                          # --elastic: only eager messages (module doc)
            _allreduce_in_pieces(mpi_comm, buf, op)
    except MPI.Exception as exc:       # ULFM (--elastic): a rank died during the call
        raise_if_lost(exc, mpi_comm, comm.rank, "was in MPI_Allreduce")
        raise
    kernels.finish(buf, op, comm.size)


def _allreduce_in_pieces(mpi_comm, buf: np.ndarray, op: Op) -> None:
    """Pieces of at most ELASTIC_PIECE_BYTES, all in flight at once (MPI_Iallreduce each, then
    one Waitall: as fast as one call here, 0.6-1.0x of its time at 512 KiB-4 MiB, -np 3)."""
    step = max(1, ELASTIC_PIECE_BYTES // buf.itemsize)
    if buf.dtype in _USER_OP_DTYPES:   # a Python callback reduces these: one blocking call at a time
        for start in range(0, buf.size, step):
            _allreduce(mpi_comm, buf[start:start + step], op)
        return
    boolean = buf.dtype is _BOOL or buf.dtype == _BOOL
    mpi_op = _BOOL_OPS[op] if boolean else _MPI_OPS[op]
    requests = [mpi_comm.Iallreduce(MPI.IN_PLACE, [piece, MPI.C_BOOL] if boolean else piece, op=mpi_op)
                for piece in (buf[start:start + step] for start in range(0, buf.size, step))]
    MPI.Request.Waitall(requests)


def _allreduce(mpi_comm, buf: np.ndarray, op: Op) -> None:
    carrier = _USER_OP_DTYPES.get(buf.dtype)
    if carrier is not None:
        datatype, view = carrier
        mpi_comm.Allreduce(MPI.IN_PLACE, [buf.view(view), datatype], op=_user_op(buf.dtype, op))
    elif buf.dtype is _BOOL or buf.dtype == _BOOL:
        mpi_comm.Allreduce(MPI.IN_PLACE, [buf, MPI.C_BOOL], op=_BOOL_OPS[op])
    else:
        mpi_comm.Allreduce(MPI.IN_PLACE, buf, op=_MPI_OPS[op])
