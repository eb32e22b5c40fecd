"""Rank script: the tree and rd allreduces on real MPI processes, checked against MPI_Allreduce.

Run by tests/test_tree.py as ``mpirun -np P python tree_rd_check.py tree,rd SEGMENT_BYTES``
(both algorithms in one job: start-up, not the cases, dominates on a small machine).

For every count, dtype and op: the result must be bitwise identical on every
rank (the allgathered SHA-256 of its bytes agree) and match the reference
within tolerance. For float64 holding small integers, where every summation
order is exact, it must equal MPI's own ``Allreduce`` exactly.
"""
import hashlib
import sys

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.kernels.reference import allreduce_reference, tolerance
from allreduce.ops import SUPPORTED_DTYPES, Op

world = MPI.COMM_WORLD
algos, segment_bytes = sys.argv[1].split(","), int(sys.argv[2])
ar.init(segment_bytes=segment_bytes)       # small segments: exercise the pipeline across processes
p, me = ar.size(), ar.rank()
rng = np.random.default_rng(4321)          # same stream on every rank: each rank can build every input
MPI_OPS = {Op.SUM: MPI.SUM, Op.PRODUCT: MPI.PROD, Op.MIN: MPI.MIN, Op.MAX: MPI.MAX}


digests: list[tuple[str, str]] = []        # (case, SHA-256 of the result): compared across ranks at the end


def record(x: np.ndarray, what: str) -> None:
    digests.append((what, hashlib.sha256(x.tobytes()).hexdigest()))


def inputs_for(count, dtype, op):
    if op == Op.PRODUCT:
        return [rng.integers(1, 3, count).astype(dtype) for _ in range(p)]
    if dtype.kind in "iu":
        return [rng.integers(0, 30, count).astype(dtype) for _ in range(p)]
    return [(rng.standard_normal(count) * 4).astype(dtype) for _ in range(p)]


checked = 0
for algo in algos:
    for count in sorted({0, 1, max(p - 1, 0), p + 1, 37, 1000, 4099}):
        # Every dtype x op at one count; one op per dtype (rotating) at the others: oversubscribed
        # ranks on a small machine pay for every synchronisation, so the run is kept short.
        full = count == 1000
        for i, dtype in enumerate(SUPPORTED_DTYPES):
            for op in (Op if full else [Op((i + count) % len(Op))]):
                xs = inputs_for(count, dtype, op)
                got = ar.allreduce(xs[me], op=op, algorithm=algo)
                what = f"{algo} count={count} {dtype} {op}"
                record(got, what)
                want = allreduce_reference(xs, op)
                if dtype.kind == "f" or dtype.name == "bfloat16":
                    tol = tolerance(dtype, p, op)
                    g64, w64 = got.astype(np.float64), want.astype(np.float64)
                    scale = np.abs(np.stack([x.astype(np.float64) for x in xs])).sum(0) + np.abs(w64)
                    ok = np.all(np.abs(g64 - w64) <= tol * scale)
                else:
                    ok = np.array_equal(got, want)
                assert ok, f"{what}: {got[:6]} != {want[:6]}"
                checked += 1
        # Exact against MPI_Allreduce itself: integer-valued float64, so every order gives the same sum.
        for op, mpi_op in (MPI_OPS.items() if count in (1, p + 1, 4099) else ()):
            x = rng.integers(1, 3 if op == Op.PRODUCT else 1000, count).astype(np.float64) + (me % 2)
            ref = np.empty_like(x)
            world.Allreduce(x, ref, op=mpi_op)
            got = ar.allreduce(x, op=op, algorithm=algo)
            record(got, f"{algo} vs MPI count={count} {op}")
            assert np.array_equal(got, ref), f"{algo} count={count} {op}: {got[:6]} != MPI {ref[:6]}"
            checked += 1

# Bitwise identity across ranks, every case at once (one allgather instead of one per case).
every = world.allgather(digests)
for i, (what, digest) in enumerate(digests):
    assert all(d[i] == (what, digest) for d in every), f"{what}: results differ bitwise across ranks"
if me == 0:
    print(f"OK {','.join(algos)} on {p} ranks: {checked} cases, segment_bytes={segment_bytes}")
ar.shutdown()
