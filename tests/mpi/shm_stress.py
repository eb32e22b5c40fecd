"""Rank script: thousands of back-to-back shm (or hierarchical) allreduces of random sizes, all checked.

Run by tests/test_shm.py and tests/test_hierarchical.py as
``mpirun -np P python shm_stress.py ALGO ITERS SLOT_BYTES [NODE_SIZE]``.

No barrier or metadata check between calls, so a rank may start call k+1
while a peer still copies out call k: exactly the overlap a race would hit.
Inputs hold small integers, so every summation order gives the exact
answer and each result is compared bit for bit with the reference.
"""
import functools
import sys

import numpy as np
from mpi4py import MPI

from allreduce.algorithms import hierarchical, shm
from allreduce.buffers import Workspace
from allreduce.ops import Op
from allreduce.transport.mpi import MPITransport
from rank_checks import check_result

algo, iters, slot = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
node_size = int(sys.argv[4]) if len(sys.argv) > 4 else 0
comm = MPITransport()
p, me = comm.size, comm.rank
if algo == "shm":
    run = functools.partial(shm.allreduce, slot_bytes=slot)
else:
    run = functools.partial(hierarchical.allreduce, slot_bytes=slot, node_size=node_size)
rng = np.random.default_rng(7)            # same stream on every rank: each rank builds every input
workspace = Workspace()
dtypes = [np.float32, np.float64, np.int32, np.int8, np.float16]
ops = [Op.SUM, Op.AVERAGE, Op.MAX, Op.MIN]
for it in range(iters):
    count = int(rng.choice([0, 1, 2, 3, 5, 17, 100, 1000])) if it % 10 else int(rng.integers(0, 20_000))
    dtype, op = np.dtype(dtypes[it % len(dtypes)]), ops[(it // len(dtypes)) % len(ops)]
    hi = 3 if dtype.itemsize < 4 else 1000
    xs = [rng.integers(-hi, hi, count).astype(dtype) for _ in range(p)]
    buf = xs[me].copy()
    run(comm, buf, op, workspace=workspace, segment_bytes=1 << 12)
    check_result(buf, xs, op, me, f"iteration {it}: {algo} count={count}", MPI.COMM_WORLD.Abort)
blobs = MPI.COMM_WORLD.allgather(buf.tobytes())
assert all(b == blobs[0] for b in blobs), "last result differs across ranks"
print(f"rank {me}: {iters} {algo} allreduces OK", flush=True)
