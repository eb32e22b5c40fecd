"""Rank script: the public API under mpirun, checked against MPI_Allreduce itself.

Run by tests/test_api_mpi.py as ``mpirun -np P python api_check.py ALGOS [--large]``.
Every rank checks that its result equals MPI's own Allreduce (float64 inputs
holding small integers, so every summation order is exact) and that all ranks
hold bitwise-identical results (the allgathered bytes compare equal).
"""
import sys

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.kernels.reference import allreduce_reference, tolerance
from allreduce.ops import SUPPORTED_DTYPES, Op

world = MPI.COMM_WORLD
algos = sys.argv[1].split(",")
large = "--large" in sys.argv
ar.init()
p, me = ar.size(), ar.rank()
rng = np.random.default_rng(1234)          # same stream on every rank: each rank can build every input


def same_everywhere(x: np.ndarray, what: str) -> None:
    blobs = world.allgather(x.tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what}: results differ bitwise across ranks"


def inputs_for(count, dtype, op):
    ints = dtype.kind in "iu"
    lo, hi = ((0, 3) if op == Op.PRODUCT else (0, 50)) if ints or op != Op.PRODUCT else (1, 3)
    return [rng.integers(lo, hi, count).astype(dtype) for _ in range(p)]


# Every dtype with Sum and Max, every op with float32, bfloat16 and int32. The full
# dtype x op x p matrix runs on the in-process transport (tests/test_<algorithm>.py);
# here the point is real processes, real MPI and bitwise identity across them.
CASES = sorted({(d, op) for d in SUPPORTED_DTYPES for op in (Op.SUM, Op.MAX)}
               | {(np.dtype(d), op) for d in (np.float32, ar.bfloat16, np.int32) for op in Op},
               key=lambda c: (c[0].name, c[1]))
checked = 0
for algo in algos:
    # --large: the 64 MiB case and the API checks only; the matrix already ran for this algorithm.
    for count in ([] if large else sorted({0, 1, max(p - 1, 0), p + 1, 1000, 4099})):
        for dtype, op in CASES:
            if True:
                xs = inputs_for(count, dtype, op)
                got = ar.allreduce(xs[me], op=op, algorithm=algo)
                same_everywhere(got, f"{algo} count={count} {dtype} {op}")
                want = allreduce_reference(xs, op)
                if dtype.kind == "f" or dtype.name == "bfloat16":
                    tol = tolerance(dtype, p, op)
                    ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
                else:
                    ok = np.array_equal(got, want)
                assert ok, f"{algo} count={count} {dtype} {op}: {got[:6]} != {want[:6]}"
                checked += 1
    # Versus MPI_Allreduce itself, exact (integer-valued float64).
    x = rng.integers(-1000, 1000, 12345).astype(np.float64) + me
    ref = np.empty_like(x)
    world.Allreduce(x, ref, op=MPI.SUM)
    assert np.array_equal(ar.allreduce(x, op=ar.Sum, algorithm=algo), ref), f"{algo} != MPI_Allreduce"
    # In place, non-contiguous, any shape.
    base = np.arange(60, dtype=np.float32).reshape(6, 10) * (me + 1)
    view = base[::2, 1::3]
    expect = view * 0 + np.arange(60, dtype=np.float32).reshape(6, 10)[::2, 1::3] * sum(range(1, p + 1))
    assert ar.allreduce_(view, op=ar.Sum, algorithm=algo) is view
    assert np.array_equal(view, expect), f"{algo}: in-place strided"
    out = ar.allreduce(np.ones((3, 4), np.float32), op=ar.Average, algorithm=algo)
    assert out.shape == (3, 4) and np.all(out == 1)
    if large:                                   # 64 MiB of float32
        big = np.full(16 << 20, me + 1, dtype=np.float32)
        got = ar.allreduce(big, op=ar.Sum, algorithm=algo)
        assert np.all(got == p * (p + 1) / 2), f"{algo}: 64 MiB"
        same_everywhere(got[::4096], f"{algo} 64 MiB")

# Mismatched count raises on every rank, naming every rank's value.
if p > 1:
    for algo in algos:
        try:
            ar.allreduce(np.ones(10 + me, np.float32), algorithm=algo)
        except ar.MismatchError as e:
            text = str(e)
            assert all(f"rank {r}: {10 + r}" in text for r in range(p)), text
        else:
            raise AssertionError("count mismatch not detected")
        try:
            ar.allreduce(np.ones(4, [np.float32, np.float64][me % 2]), algorithm=algo)
        except ar.MismatchError as e:
            assert "dtype differs" in str(e) and "rank 1: float64" in str(e), str(e)
        else:
            raise AssertionError("dtype mismatch not detected")
        try:
            ar.allreduce(np.ones(4, np.float32), op=[ar.Sum, ar.Max][me % 2], algorithm=algo)
        except ar.MismatchError as e:
            assert "op differs" in str(e), str(e)
        else:
            raise AssertionError("op mismatch not detected")
        # still usable afterwards
        assert np.all(ar.allreduce(np.ones(5), op=ar.Sum, algorithm=algo) == p)

# Local errors, before any communication.
for bad in (np.array(["a"]), np.array([1 + 2j]), np.array([object()])):
    try:
        ar.allreduce(bad, op=ar.Max)
    except TypeError as e:
        assert "unsupported dtype" in str(e)
    else:
        raise AssertionError(f"{bad.dtype} accepted")
try:
    ar.broadcast(np.ones(3), root_rank=p)
except TypeError as e:
    assert "root_rank" in str(e)
else:
    raise AssertionError("root_rank out of range accepted")
ar.barrier()
ar.shutdown()
try:
    ar.allreduce(np.ones(3))
except TypeError as e:
    assert "init" in str(e)
else:
    raise AssertionError("call after shutdown accepted")
world.Barrier()
if me == 0:
    print(f"OK {checked} cases on {p} ranks: {','.join(algos)}")
