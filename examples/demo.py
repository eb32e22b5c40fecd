"""The short demo: ``bash scripts/demo.sh`` (or ``allreduce-run -np 4 python examples/demo.py``).

Every rank contributes ``rank`` and all ranks get the same sum; then each
algorithm reduces 4 MiB and rank 0 prints how long each took.
"""
import time

import numpy as np

import allreduce as ar
from allreduce import algorithms

ar.init()
me, p = ar.rank(), ar.size()
y = ar.allreduce(np.ones(10) * me, op=ar.Sum)
print(f"rank {me}: allreduce(ones(10) * rank, Sum) = {y[:3]}...  expected {sum(range(p))}", flush=True)
ar.barrier()

x = np.random.default_rng(me).standard_normal(1 << 20).astype(np.float32)   # 4 MiB
reference = ar.allreduce(x, op=ar.Sum, algorithm="mpi")
rows = []
for name in algorithms.NAMES:
    try:
        algorithms.get(name)
    except (ImportError, ValueError):
        continue
    got = ar.allreduce(x, op=ar.Sum, algorithm=name)          # warm-up (and numba compile)
    ar.barrier()
    t0 = time.perf_counter()
    for _ in range(5):
        got = ar.allreduce(x, op=ar.Sum, algorithm=name)
    dt = (time.perf_counter() - t0) / 5
    err = float(np.max(np.abs(got - reference)) / np.max(np.abs(reference)))
    rows.append((name, dt * 1e3, err))
if me == 0:
    print(f"\n4 MiB float32 Sum on {p} ranks (time of rank 0, average of 5):")
    print(f"{'algorithm':>14} {'time (ms)':>10} {'max rel. diff vs mpi':>22}")
    for name, ms, err in rows:
        print(f"{name:>14} {ms:10.2f} {err:22.2e}")
ar.shutdown()
