"""Small swaps through MPI and through the shared-memory mailboxes (docs/notes.md, "Small messages: mailboxes").

    allreduce-run --bind-to core -np 2 python docs/examples/mailbox_latency.py

Two transports on the same ranks, one with mailboxes and one without, each timing a bare
``exchange`` and a whole recursive-doubling allreduce; native ``MPI_Allreduce`` for scale.
Microseconds per call: the slowest rank's best of 7 blocks, taken round-robin over the five.
"""
import time

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.comm import Communicator
from allreduce.config import Config
from allreduce.transport.mpi import MPITransport

world = MPI.COMM_WORLD
me, p = world.Get_rank(), world.Get_size()
config = Config(check=False, autotune=False)
over_mpi = Communicator(MPITransport(mailbox=False), config=config)
boxed = Communicator(MPITransport(mailbox=True), config=config)
assert boxed.transport.mailbox is not None, "run the ranks on one node"
peer = me ^ 1
assert p == 2, "two ranks: each swaps with the other"


def per_call(fns: list, calls: int = 5000, blocks: int = 7) -> list[float]:
    """Each of ``fns``, timed in blocks round-robin (so a slow spell of the machine hits them all)."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        for _ in range(200):
            fn()
    for _ in range(blocks):
        for i, fn in enumerate(fns):
            world.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return [world.allreduce(t, op=MPI.MAX) * 1e6 for t in best]


rows = []
import sys
for nbytes in [int(a) for a in sys.argv[1:]] or (8, 512, 4096, 16384):
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    times = per_call([lambda: over_mpi.transport.exchange(x, y, peer),
                      lambda: boxed.transport.exchange(x, y, peer),
                      lambda: over_mpi.allreduce_(x, ar.Sum, algorithm="rd"),
                      lambda: boxed.allreduce_(x, ar.Sum, algorithm="rd"),
                      lambda: over_mpi.allreduce_(x, ar.Sum, algorithm="mpi")])
    rows.append(f"{nbytes:>7}" + "".join(f" {t:>10.2f}" for t in times))
if me == 0:
    print(f"{p} ranks, us per call    exchange             rd allreduce          native")
    print(f"{'bytes':>7} {'MPI':>10} {'mailbox':>10} {'MPI':>10} {'mailbox':>10} {'MPI_Allr.':>10}")
    print("\n".join(rows))
boxed.close()
over_mpi.close()
