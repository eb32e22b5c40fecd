"""Rank script: the ``mpi`` algorithm's integer sums wrap as C and numpy do (tests/test_api_mpi.py).

Open MPI 5.0's vectorised sum saturates int8, uint8, int16 and uint16 where they overflow (229 +
229 = 255 in uint8), so allreduce/algorithms/native.py reduces those with a user op of our own
kernel. Every integer dtype, near its limits (so the sums overflow), at 17, 1000 and 5000
elements, by ``mpi``, ``ring`` and ``auto``, every op, against numpy's wrapping reduction of
every rank's input; the results bitwise equal on every rank. Prints "rank R: native_wrap_check OK".
"""
import numpy as np

import allreduce as ar

ar.init()
me, p = ar.rank(), ar.size()
for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64):
    info = np.iinfo(dtype)
    for n in (17, 1000, 5000):
        rng = np.random.default_rng(1000 * me + n)
        x = rng.integers(info.max // 2, info.max, n, endpoint=True).astype(dtype)   # any two overflow
        x[::3] = rng.integers(info.min, info.max, len(x[::3]), endpoint=True).astype(dtype)
        every = ar.allgather_object(x)
        for op, reduce in ((ar.Sum, np.add), (ar.Min, np.minimum), (ar.Max, np.maximum),
                           (ar.Product, np.multiply)):
            want = every[0].copy()
            for other in every[1:]:
                want = reduce(want, other)                       # numpy wraps, as C does
            for algorithm in ("mpi", "ring", "auto"):
                got = ar.allreduce(x.copy(), op=op, algorithm=algorithm)
                assert got.dtype == want.dtype and np.array_equal(got, want), \
                    (np.dtype(dtype).name, n, op, algorithm, got[:4], want[:4])
                blobs = ar.allgather_object(got.tobytes())
                assert all(b == blobs[0] for b in blobs), (np.dtype(dtype).name, n, op, algorithm, "differs")
ar.shutdown()
print(f"rank {me}: native_wrap_check OK", flush=True)
