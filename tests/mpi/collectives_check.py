"""Rank script: rhd allreduce and the other collectives under mpirun, against MPI's own.

Run by tests/test_collectives.py as ``mpirun -np P python collectives_check.py``.

* rhd allreduce vs ``MPI_Allreduce`` (``algorithms.native``): Sum for every dtype,
  every op for float32, float16 and int32; exact for integers, Min and Max,
  within the float tolerance otherwise.
  Every rank's rhd result must also be bitwise identical to every other's.
* ``Communicator.broadcast`` / ``allgather`` / ``reducescatter`` /
  ``broadcast_object`` / ``allgather_object`` vs mpi4py's ``Bcast``,
  ``Allgatherv``, ``Reduce_scatter``, ``bcast`` and ``allgather``.

Any failure prints the traceback and aborts the job, so no rank hangs.
"""
import sys
import traceback

import numpy as np
from mpi4py import MPI

from allreduce import partition
from allreduce.algorithms import broadcast, native, rhd
from allreduce.buffers import Workspace
from allreduce.comm import Communicator
from allreduce.kernels.reference import tolerance
from allreduce.ops import SUPPORTED_DTYPES, Op
from allreduce.transport.mpi import MPITransport

world = MPI.COMM_WORLD
p, me = world.Get_size(), world.Get_rank()
MPI_OPS = {Op.SUM: MPI.SUM, Op.AVERAGE: MPI.SUM, Op.MIN: MPI.MIN, Op.MAX: MPI.MAX, Op.PRODUCT: MPI.PROD}


def my_input(count: int, dtype, op: Op, seed: int) -> np.ndarray:
    """This rank's input: values that keep Product and integer sums meaningful."""
    rng = np.random.default_rng(seed * 100 + me)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if dtype.kind in "iu":
        lo, hi = (0, 200) if dtype.kind == "u" else (-100, 100)
        if op == Op.PRODUCT:
            lo, hi = (0, 4) if dtype.kind == "u" else (-3, 4)
        elif dtype.itemsize == 1 and op in (Op.SUM, Op.AVERAGE):
            # Open MPI's vectorised op saturates 8-bit sums that overflow instead of wrapping
            # (open-mpi/ompi#8045, "wontfix"); keep p * max in range. Wrap-around itself is
            # tested against numpy in tests/test_rhd.py.
            lo, hi = (0, 40) if dtype.kind == "u" else (-20, 20)
        return rng.integers(lo, hi, count).astype(dtype)
    if op == Op.PRODUCT:
        return rng.uniform(0.5, 1.5, count).astype(dtype)
    return (rng.standard_normal(count) * 4).astype(dtype)


def same_everywhere(x: np.ndarray, what: str) -> None:
    blobs = world.allgather(x.tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what}: results differ bitwise across ranks"


def abs_sum(x: np.ndarray, counts=None) -> np.ndarray:
    """Sum over ranks of |x| in float64 (reduce-scattered by ``counts``): bounds any order's rounding."""
    x = np.abs(x.reshape(-1).astype(np.float64))
    if counts is None:
        out = np.empty_like(x)
        world.Allreduce(x, out, op=MPI.SUM)
    else:
        out = np.empty(counts[me], np.float64)
        world.Reduce_scatter(x, out, recvcounts=counts, op=MPI.SUM)
    return out


def assert_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray, dtype, op: Op, what: str) -> None:
    """Exact for integers, Min and Max; else within twice the float tolerance of each other."""
    tol = tolerance(dtype, p, op)
    g, w = got.astype(np.float64), want.astype(np.float64)
    if tol == 0:
        assert np.array_equal(g, w, equal_nan=True), f"{what}: got {g[:6]} want {w[:6]}"
        return
    if op == Op.PRODUCT:
        scale = np.abs(w)
    assert np.all(np.abs(g - w) <= 2 * tol * (scale + np.abs(w)) + 1e-300), f"{what}: got {g[:6]} want {w[:6]}"


def check_rhd(transport: MPITransport) -> None:
    workspace = Workspace()
    # Every dtype with Sum; every other op on one float, one half and one integer dtype. The
    # thread tests cover the full product; this is about real processes and MPI's answer, and
    # each extra (kernel, dtype) pair costs every process a numba cache load at startup.
    others = (Op.AVERAGE, Op.MIN, Op.MAX, Op.PRODUCT)
    cases = [(d, Op.SUM) for d in SUPPORTED_DTYPES] + \
        [(np.dtype(d), op) for d in (np.float32, np.float16, np.int32) for op in others] + \
        [(np.dtype(bool), Op.MIN)]                  # MPI_LAND (Sum above: MPI_LOR)
    for dtype, op in cases:
        for count in (0, 1, 7, 30011):
            x = my_input(count, dtype, op, seed=count)
            ours, theirs = x.copy(), x.copy()
            rhd.allreduce(transport, ours, op, workspace=workspace)
            native.allreduce(transport, theirs, op, workspace=workspace)
            what = f"rhd {dtype} {op!r} count {count}"
            same_everywhere(ours, what)
            assert_close(ours, theirs, abs_sum(x), dtype, op, what)


def check_broadcast(comm: Communicator) -> None:
    for root in range(p):
        for count, large in [(0, broadcast.LARGE_BYTES), (1000, broadcast.LARGE_BYTES), (1000, 1),
                             (broadcast.LARGE_BYTES // 8 + 5, broadcast.LARGE_BYTES)]:
            x = my_input(count, np.float64, Op.SUM, seed=root)
            want = x.copy()
            world.Bcast(want, root=root)
            ours = x.copy()
            broadcast.broadcast(comm.transport, ours, root, large_bytes=large)
            assert ours.tobytes() == want.tobytes(), f"broadcast root {root} count {count} large {large}"
        got = comm.broadcast(my_input(12, np.int32, Op.SUM, seed=7).reshape(3, 4), root_rank=root)
        want = my_input(12, np.int32, Op.SUM, seed=7)
        world.Bcast(want, root=root)
        assert got.shape == (3, 4) and got.tobytes() == want.tobytes(), f"Communicator.broadcast root {root}"
        obj = {"from": me, "data": list(range(me * 10))}
        assert comm.broadcast_object(obj, root) == world.bcast(obj, root=root), f"broadcast_object root {root}"


def check_allgather(comm: Communicator) -> None:
    for dtype in (np.float32, np.int64, np.uint8):
        rows = (3 * me) % 4                                     # rank 0 (and maybe others) give 0 rows
        x = my_input(rows * 5, dtype, Op.SUM, seed=3).reshape(rows, 5)
        counts = world.allgather(x.size)
        want = np.empty(sum(counts), dtype)
        world.Allgatherv(x.reshape(-1), [want, counts])
        got = comm.allgather(x)
        assert got.shape == (sum(counts) // 5, 5) and got.tobytes() == want.tobytes(), f"allgather {dtype}"
    obj = ["rank", me, "z" * (me * 37)]
    assert comm.allgather_object(obj) == world.allgather(obj), "allgather_object"


def check_reducescatter(comm: Communicator) -> None:
    cases = [(np.float32, op) for op in Op] + [(np.int64, Op.SUM), (np.int64, Op.AVERAGE)]
    for dtype, op in cases:
        for rows in (0, p - 1, 2 * p + 1):
            x = my_input(rows * 3, dtype, op, seed=rows).reshape(rows, 3)
            counts = [n * 3 for n in partition.chunk_sizes(rows, p)]
            want = np.empty(counts[me], dtype)
            world.Reduce_scatter(x.reshape(-1), want, recvcounts=counts, op=MPI_OPS[op])
            if op == Op.AVERAGE:                           # MPI has no Average: its sum, then / p
                if want.dtype.kind == "f":
                    want = (want.astype(np.float64) / p).astype(dtype)
                else:
                    q = np.abs(want.astype(np.int64)) // p
                    want = np.where(want >= 0, q, -q).astype(dtype)
            got = comm.reducescatter(x, op)
            assert got.shape == (counts[me] // 3, 3), f"reducescatter shape {got.shape}"
            assert_close(got.reshape(-1), want, abs_sum(x, counts), dtype, op,
                         f"reducescatter {dtype} {op!r} rows {rows}")


def main() -> None:
    transport = MPITransport()
    comm = Communicator(transport)
    check_rhd(transport)
    check_broadcast(comm)
    check_allgather(comm)
    check_reducescatter(comm)
    world.Barrier()
    if me == 0:
        print(f"collectives_check OK on {p} ranks", flush=True)
    comm.close()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - any failure must end the whole job, not leave peers waiting
        print(f"rank {me} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        world.Abort(1)
