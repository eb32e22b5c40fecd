"""Rank script: auto's kept pick for a large size slows down, and the size is tuned again.

Run by tests/test_autotune.py as ``mpirun -np 2 python autotune_watch.py``. A 1 MiB float32
allreduce is called until auto keeps a pick A; then every call of A is made slower (a sleep of
three times its winning score, on every rank), and the calls go on until auto keeps another
algorithm. Every result is checked against the exact sum.
"""
import time

import numpy as np

import allreduce as ar
from allreduce import algorithms, autotune
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import Op

comm = ar.init()
p, me = ar.size(), ar.rank()
n = autotune.WATCH_BYTES // 4
xs = [np.random.default_rng(r).integers(-50, 50, n).astype(np.float32) for r in range(p)]
want = allreduce_reference(xs, Op.SUM).tobytes()
tuner, nbytes = comm.tuner, n * 4


def call():
    got = comm.allreduce_(xs[me].copy(), ar.Sum)
    assert got.tobytes() == want, "wrong result"


# Limits in seconds, not calls (rank 0's clock, broadcast every 64 calls, so every rank stops at the
# same call): while every contender runs 3x the model's prediction (unbound ranks under the test
# harness can), each size is timed up to MAX_RECHECKS more times, the gaps doubling.
calls, deadline = 0, time.monotonic() + 60
while nbytes not in comm.auto_picks and (calls % 64 or comm.broadcast_object(time.monotonic() < deadline)):
    call()
    calls += 1
first = comm.auto_picks.get(nbytes)
assert first is not None and nbytes in tuner.watches, f"no pick kept after {calls} calls"
delay = 3 * tuner.watches[nbytes].score
real = algorithms.get(first)


def slowed(*args, **kwargs):
    time.sleep(delay)
    return real(*args, **kwargs)


algorithms._LOADED[first] = slowed
more, deadline = 0, time.monotonic() + 90
while (tuner.reopened == 0 or comm.auto_picks.get(nbytes) in (None, first)) \
        and (more % 64 or comm.broadcast_object(time.monotonic() < deadline)):
    call()
    more += 1
second = comm.auto_picks.get(nbytes)
assert tuner.reopened >= 1, f"{first} slowed 4x and was never tuned again in {more} calls"
assert second not in (None, first), f"tuned again but kept {second}"
ar.shutdown()
if me == 0:
    print(f"OK autotune_watch on {p} ranks: kept {first} after {calls} calls; slowed, it was tuned "
          f"again and {second} kept after {more} more")
