"""Rank script: one job under ``allreduce-run --cluster``, checking placement, then the matrices.

Run by tests/test_cluster.py as ``allreduce-run --cluster=PREFIX -np P python cluster_check.py HOSTS [--tf]``.

1. Placement: each host's ranks see that host's address as their hostname, ``ar.local_rank()`` /
   ``local_size()`` and hierarchical's node split follow mpirun's real placement (k consecutive ranks
   per host), ``ALLREDUCE_FAKE_NODE_SIZE`` is not set, ranks of different hosts share no core (while
   there are as many cores as hosts), and the job yields: a 4 KiB allreduce across an oversubscribed
   host takes well under a scheduler time slice (179 ms per call when ranks spun, issue 26);
   ``auto`` prices the network: the link measured at init, hierarchical among its candidates.
2. The core correctness matrix (matrix_check.py's three scripts) with hierarchical and auto added.
3. The engine's any-order test (engine_stress.py).
4. With ``--tf`` (an even world size): the tfops training-equivalence test (tf_train.py).
Each prints its own OK line; a failure raises (the faults hook aborts the job).
"""
import os
import runpy
import socket
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.algorithms import hierarchical

HERE = Path(__file__).parent
hosts, with_tf = int(sys.argv[1]), "--tf" in sys.argv
world = MPI.COMM_WORLD
p, me = world.Get_size(), world.Get_rank()

# -- 1. placement -----------------------------------------------------------------------------------
assert "ALLREDUCE_FAKE_NODE_SIZE" not in os.environ, "the cluster must not fake its nodes"
k = -(-p // hosts)                                  # ranks per host, as allreduce-run --cluster maps them
ar.init()
mine = (socket.gethostname(), sorted(os.sched_getaffinity(0)), ar.local_rank(), ar.local_size())
everyone = world.allgather(mine)
names = [e[0] for e in everyone]
assert len(set(names)) == hosts, f"rank {me}: expected {hosts} hostnames, got {names}"
for r, (name, cores, lrank, lsize) in enumerate(everyone):
    host = r // k
    assert name == names[host * k], f"rank {r} on {name}, expected the host of rank {host * k}"
    assert (lrank, lsize) == (r % k, min(k, p - host * k)), f"rank {r}: local {lrank}/{lsize}, host {host}"
lay = hierarchical.layout(ar.communicator().transport)
assert lay.nodes == hosts, f"rank {me}: hierarchical sees {lay.nodes} nodes, not {hosts}"
# auto across real nodes (allreduce/algorithms/network.py): the link measured at init, the same on every
# rank; hierarchical a candidate where hosts hold several ranks, shm never; the engine's choice the same.
c = ar.communicator()
link = c.transport.link
assert c.nodes == hosts and link is not None and link.source == "measured" and link.alpha > 0 and link.beta > 0, \
    f"rank {me}: nodes {c.nodes}, link {link}"
assert world.allgather((link.alpha, link.beta)) == [(link.alpha, link.beta)] * p, "ranks priced different links"
assert ("hierarchical" in c.auto_candidates) == (k > 1) and "shm" not in c.auto_candidates, c.auto_candidates
from allreduce import api                               # noqa: E402
assert api._engine.comm.auto_candidates == c.auto_candidates and api._engine.comm.nodes == hosts
for nbytes in (4 << 10, 16 << 20):
    assert c.ranked(nbytes)[0][1] > 0 and len(set(world.allgather(c.pick(nbytes)))) == 1
by_host = {}
for name, cores, _, _ in everyone:
    by_host.setdefault(name, set()).update(cores)
if hosts <= os.cpu_count():                         # enough cores for one each: no two hosts may share one
    sets = list(by_host.values())
    shared = [(a, b) for i, a in enumerate(sets) for b in sets[i + 1:] if a & b]
    assert not shared, f"rank {me}: hosts share cores {shared}: ranks of different hosts would spin on one"
assert os.environ.get("OMPI_MCA_mpi_yield_when_idle") == "1", "mpirun was not told to yield when idle"
x = np.ones(1024, np.float32)
times = []
for _ in range(15):
    t = time.perf_counter()
    world.Allreduce(MPI.IN_PLACE, x)
    times.append(time.perf_counter() - t)
slow = sorted(world.allgather(sorted(times)[len(times) // 2]))[-1]
assert slow < 0.1, f"4 KiB allreduce takes {slow * 1e3:.1f} ms (median): ranks spin instead of yielding"
ar.shutdown()
print(f"rank {me}: cluster placement OK ({hosts} hosts x {k}, 4 KiB in {slow * 1e6:.0f} us)", flush=True)

# -- 2-4. the matrices, the engine, training ----------------------------------------------------------
JOBS = [("api_check.py", ["ring,mpi,hierarchical,auto"]), ("tree_rd_check.py", ["tree,rd", "512"]),
        ("collectives_check.py", []), ("engine_stress.py", ["3", "65536"])]
if with_tf:
    JOBS.append(("tf_train.py", []))
for script, args in JOBS:
    sys.argv = [str(HERE / script), *args]
    t0 = time.perf_counter()
    runpy.run_path(str(HERE / script), run_name="__main__")
    if me == 0:
        print(f"  {script} took {time.perf_counter() - t0:.1f} s", flush=True)
    sys.stdout.flush()
print(f"rank {me}: cluster_check OK", flush=True)
