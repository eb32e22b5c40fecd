"""Rank script: back-to-back shm allreduces on registered buffers (``shared_empty``), all checked.

Run by tests/test_shm_registered.py as ``mpirun -np P python shm_registered.py ITERS``.

Each call reduces a random slice (the same on every rank) of one registered array, through the
public ``ar.allreduce_`` (or, every other call, shm itself with 1 KiB windows) with no metadata
check and no barrier, and writes the next inputs the moment it returns: a rank returning while a
peer still reads its input, or still writes the result into its array, would show as a wrong
integer. Large calls (up to 3 M elements) come every tenth. Then every rank passes a different
slice, and every rank must raise MismatchError instead of hanging or reducing garbage.
"""
import sys

import numpy as np

import allreduce as ar
from allreduce.algorithms import shm
from allreduce.buffers import Workspace
from allreduce.transport import shared
from rank_checks import check_result

iters = int(sys.argv[1])
ar.init(check=False)
comm = ar.communicator()
p, me = ar.size(), ar.rank()
rng = np.random.default_rng(11)            # the same stream on every rank: each builds every input
dtypes = [np.float32, np.int32, np.float64, np.int8, np.float16]
big = 3_000_000
arrays = {np.dtype(d): ar.shared_empty(big + 64, d) for d in dtypes}
assert shared.find(comm.transport, arrays[np.dtype(np.float32)]) is not None
for it in range(iters):
    count = int(rng.integers(0, big)) if it % 10 == 0 else int(rng.choice([0, 1, 2, 3, 5, 17, 100, 4097]))
    start = int(rng.integers(0, 64))
    dtype = np.dtype(dtypes[it % len(dtypes)])
    op = [ar.Sum, ar.Max, ar.Min, ar.Average][(it // len(dtypes)) % 4]
    hi = 3 if dtype.itemsize < 4 else 1000
    xs = [rng.integers(-hi, hi, count).astype(dtype) for _ in range(p)]
    buf = arrays[dtype][start:start + count]
    buf[:] = xs[me]
    if it % 2:                      # straight to the algorithm, through 1 KiB windows (many per call)
        shm.allreduce(comm.transport, buf, op, workspace=Workspace(), slot_bytes=1024)
    else:
        ar.allreduce_(buf, op=op, algorithm="shm")
    check_result(buf, xs, op, me, f"iteration {it}: count={count}", comm.transport.comm.Abort)
blobs = comm.transport.comm.allgather(buf.tobytes())
assert all(b == blobs[0] for b in blobs), "last result differs across ranks"
print(f"rank {me}: {iters} registered allreduces OK", flush=True)

f32 = arrays[np.dtype(np.float32)]
try:
    ar.allreduce_(f32[me:me + 1000], op=ar.Sum, algorithm="shm")
except ar.MismatchError as exc:
    assert "differ across ranks" in str(exc), exc
    print(f"rank {me}: mismatch raised: {exc}", flush=True)
ar.shutdown()
