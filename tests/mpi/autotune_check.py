"""Rank script: auto's run-time tuner under mpirun (tests/test_autotune.py).

``mpirun -np P python autotune_check.py [--off]``. Every rank but rank 0 is given a cost model that
ranks the algorithms the other way round, as if each node had fitted its own file: auto must still
run the same algorithm on every rank on every call (rank 0's plan or pick is broadcast), or the job
hangs (the test's timeout) or returns wrong sums. That holds while the tuner times a size, for a
size it has no room for (it times one size at a time here), and with the tuner off (``--off``).
Two sizes are reduced interleaved, others one after another; every result is checked exactly
(small integers), the last of each size bitwise across ranks, and the picks are compared across
ranks.
"""
import sys

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce import autotune

world = MPI.COMM_WORLD
off = "--off" in sys.argv
ar.init()
p, me = ar.size(), ar.rank()
comm = ar.communicator()
if off:
    assert comm.tuner is None, "ALLREDUCE_AUTOTUNE=0 left the tuner on"
else:
    assert comm.tuner is not None
    comm.tuner.max_sizes = 1                                    # the second size finds it busy
if me != 0:                                                     # a different model on this rank
    own = comm.ranked
    comm.ranked = lambda nbytes: list(reversed(own(nbytes)))
    comm.choose = lambda nbytes: comm.ranked(nbytes)[0][0]

SIZES = [1, 1024, 25_000, (1 << 18) + 3, 2 << 20]          # float32 elements
calls = 0
autotune.GAP_SECONDS = 0.01     # the recheck's gap, shortened: the same steps in a test's time
TRIES = 4 * autotune.MAX_GAP    # calls of one size before it must be decided: two timings and the gap


def call(n: int) -> np.ndarray:
    global calls
    x = np.arange(n, dtype=np.float32) % 7 + me                 # small integers: every order is exact
    got = ar.allreduce(x, op=ar.Sum)
    want = p * (np.arange(n) % 7) + p * (p - 1) / 2
    assert np.array_equal(got, want.astype(np.float32)), f"rank {me}: wrong sum at {n} elements"
    calls += 1
    return got


def tuned(n: int) -> bool:
    return n * 4 in comm.auto_picks


last = {}
a, b = SIZES[0], SIZES[2]
for _ in range(TRIES):                                           # two sizes tuned side by side
    if tuned(a) and tuned(b):
        break
    last[a], last[b] = call(a), call(b)
for n in SIZES:                                                 # the rest one after another
    for _ in range(TRIES):
        last[n] = call(n)
        if tuned(n):
            break
    last[n] = call(n)                                           # and once with the winner
for n, got in last.items():
    blobs = world.allgather(got.tobytes())
    assert all(blob == blobs[0] for blob in blobs), f"{n} elements: results differ bitwise across ranks"
picks = world.allgather(dict(comm.auto_picks))
assert all(book == picks[0] for book in picks), f"auto picked differently across ranks: {picks}"
assert sorted(picks[0]) == sorted(n * 4 for n in SIZES), picks[0]
models = world.allgather([comm.choose(n * 4) for n in SIZES])
assert any(model != models[0] for model in models[1:]), f"the ranks' models agree: nothing tested {models}"
untimed = [n * 4 for n in SIZES if off or n * 4 not in comm.tuner.decided]
assert untimed, "every size was timed: the busy tuner's path went untested"
for nbytes in untimed:                                          # rank 0's model decided these
    assert picks[0][nbytes] == world.bcast(comm.choose(nbytes), root=0), nbytes
if not off:
    books = world.allgather((dict(comm.auto_picks), comm.tuner.decided, dict(comm.tuner.trials)))
    assert all(book[:2] == books[0][:2] for book in books), f"ranks decided differently: {books}"
    assert not books[0][2], f"trials left open: {books[0][2]}"
    assert comm.tuner.decided, "no size was tuned: every size had a single contender?"
    for nbytes, times in comm.tuner.decided.items():
        assert comm.auto_picks[nbytes] == min(times, key=times.get), (nbytes, times, comm.auto_picks[nbytes])
        assert f"auto now runs {comm.auto_picks[nbytes]}" in ar.explain_choice(nbytes), ar.explain_choice(nbytes)
engine = ar.api._engine                                         # the engine's own picks agree too
if me != 0:
    engine.comm.choose = lambda nbytes: list(reversed(engine.comm.ranked(nbytes)))[0][0]
# 0.9 MB in all: one fused buffer under LONE_MANY_BYTES, so auto picks it (a lone buffer of 1 MiB or
# more on one node takes shm's many-call and never reaches the picks checked here)
for step in range(3):
    arrays = [np.arange(n, dtype=np.float32) % 7 + me for n in (3, 5000, 70_000, 150_000)]
    for n, got in zip((3, 5000, 70_000, 150_000), ar.grouped_allreduce(arrays, op=ar.Sum, name=f"g{step}")):
        want = p * (np.arange(n) % 7) + p * (p - 1) / 2
        assert np.array_equal(got, want.astype(np.float32)), f"rank {me}: engine sum wrong at {n}"
engine_picks = world.allgather(dict(engine.comm.auto_picks))
assert engine_picks[0] and all(book == engine_picks[0] for book in engine_picks), engine_picks
ar.shutdown()
if me == 0:
    tail = " (off)" if off else f": {calls} calls, tuned {sorted(comm.tuner.decided)} bytes"
    print(f"OK autotune_check on {p} ranks{tail}")
