"""Rank script: auto's run-time tuner under mpirun (tests/test_autotune.py).

``mpirun -np P python autotune_check.py [--off]``. Every rank but rank 0 is given a cost model that
ranks the algorithms the other way round, as if each node had fitted its own file: the tuner must
still run the same algorithm on every rank on every call (rank 0's plan is broadcast), or the job
hangs (the test's timeout) or returns wrong sums. Two sizes are tuned interleaved, others one after
another; every result is checked exactly (small integers), the last of each size bitwise across
ranks, and the decisions are compared across ranks.
"""
import sys

import numpy as np
from mpi4py import MPI

import allreduce as ar

world = MPI.COMM_WORLD
off = "--off" in sys.argv
ar.init()
p, me = ar.size(), ar.rank()
comm = ar.communicator()
if off:
    assert comm.tuner is None, "ALLREDUCE_AUTOTUNE=0 left the tuner on"
else:
    assert comm.tuner is not None
    if me != 0:
        own = comm.ranked
        comm.ranked = lambda nbytes: list(reversed(own(nbytes)))     # a different model on this rank

SIZES = [1, 1024, 25_000, (1 << 18) + 3, 2 << 20]          # float32 elements
calls = 0


def call(n: int) -> np.ndarray:
    global calls
    x = np.arange(n, dtype=np.float32) % 7 + me                 # small integers: every order is exact
    got = ar.allreduce(x, op=ar.Sum)
    want = p * (np.arange(n) % 7) + p * (p - 1) / 2
    assert np.array_equal(got, want.astype(np.float32)), f"rank {me}: wrong sum at {n} elements"
    calls += 1
    return got


def tuned(n: int) -> bool:
    return off or n * 4 in comm._tuned


last = {}
a, b = SIZES[0], SIZES[2]
for _ in range(400):                                            # two sizes tuned side by side
    if tuned(a) and tuned(b):
        break
    last[a], last[b] = call(a), call(b)
for n in SIZES:                                                 # the rest one after another
    for _ in range(400):
        last[n] = call(n)
        if tuned(n):
            break
    last[n] = call(n)                                           # and once with the winner
for n, got in last.items():
    blobs = world.allgather(got.tobytes())
    assert all(blob == blobs[0] for blob in blobs), f"{n} elements: results differ bitwise across ranks"
if not off:
    books = world.allgather((dict(comm._tuned), comm.tuner.decided, dict(comm.tuner.trials)))
    assert all(book[:2] == books[0][:2] for book in books), f"ranks decided differently: {books}"
    assert not books[0][2], f"trials left open: {books[0][2]}"
    assert comm.tuner.decided, "no size was tuned: every size had a single contender?"
    for nbytes, times in comm.tuner.decided.items():
        assert comm._tuned[nbytes] == min(times, key=times.get), (nbytes, times, comm._tuned[nbytes])
        assert f"auto now runs {comm._tuned[nbytes]}" in ar.explain_choice(nbytes), ar.explain_choice(nbytes)
ar.shutdown()
if me == 0:
    tail = " (off)" if off else f": {calls} calls, tuned {sorted(comm.tuner.decided)} bytes"
    print(f"OK autotune_check on {p} ranks{tail}")
