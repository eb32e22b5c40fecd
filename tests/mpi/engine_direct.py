"""Rank script: large tensors through the engine under mpirun, in each rank's own random order.

Run by tests/test_engine_mpi.py as ``mpirun -np P python engine_direct.py STEPS``. On one node,
with ``auto``, tensors of MANY_DIRECT_BYTES (64 KiB) and up skip the fusion buffer and go to one
``shm.allreduce_many`` call across the arrays (MPI shared windows, several arrays per window);
smaller ones are fused.
Some are submitted in place, some not, some strided (reduced in a copy); every result is checked
against the float64 reference and bitwise across ranks.
"""
import hashlib
import sys

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.algorithms import shm
from allreduce.engine.fusion import DIRECT_BYTES, MANY_DIRECT_BYTES
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import Op

steps = int(sys.argv[1])
world = MPI.COMM_WORLD
ar.init()                                                  # auto: on one node, direct batches take shm's many-call
p, me = ar.size(), ar.rank()
assert ar.api._running_engine().many == "shm", ar.api._running_engine().many
calls = []
real = shm.allreduce_many
shm.allreduce_many = lambda comm, bufs, op, **kw: (calls.append(len(bufs)), real(comm, bufs, op, **kw))
n = DIRECT_BYTES // 4
m = MANY_DIRECT_BYTES // 4
SIZES = {"a": n, "b": n + 5, "c": 3 * n + 1, "d": n // 2 * 3, "e": 2 * n - 7,   # float32 elements
         "f": m, "g": m - 1, "h": 5 * m + 3}                                # direct, fused, direct
checked = 0
for step in range(steps):
    shared = np.random.default_rng(step)
    xs = {k: [shared.integers(-50, 50, m).astype(np.float32) for _ in range(p)] for k, m in SIZES.items()}
    op = [Op.SUM, Op.AVERAGE, Op.MAX][step % 3]
    order = np.random.default_rng([step, me]).permutation(list(SIZES))
    mine = {k: xs[k][me].copy() for k in SIZES}
    handles = {}
    for i, k in enumerate(order):
        if i % 3 == 0:
            handles[k] = ar.allreduce_async_(mine[k], name=f"big.{k}", op=op)      # in place
        elif i % 3 == 1:
            handles[k] = ar.allreduce_async(mine[k], name=f"big.{k}", op=op)       # a new result array
        else:
            wide = np.zeros(2 * mine[k].size, np.float32)
            wide[::2] = mine[k]
            handles[k] = ar.allreduce_async(wide[::2], name=f"big.{k}", op=op)     # strided: a copy
    results = {k: h.wait() for k, h in handles.items()}
    digests = {k: hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in results.items()}
    assert all(d == digests for d in world.allgather(digests)), f"step {step}: ranks differ bitwise"
    for k, got in results.items():
        want = allreduce_reference(xs[k], op)
        assert np.ascontiguousarray(got).tobytes() == want.tobytes(), f"step {step} {k} {op!r}: wrong result"
        checked += 1
ar.shutdown()
assert max(calls, default=0) > 1, f"no direct batch of several tensors: {calls}"
assert max(calls) <= len(SIZES) - 1, f"the tensor under MANY_DIRECT_BYTES went into a many-call: {calls}"
if me == 0:
    print(f"OK engine_direct: {checked} allreduces on {p} ranks, many-calls of {sorted(set(calls))} tensors")
