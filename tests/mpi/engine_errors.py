"""Rank script: engine failures under mpirun are per tensor and raised on every rank.

Run by tests/test_engine_mpi.py as ``mpirun -np P python engine_errors.py``
(P >= 2). Checks, in order: a shape mismatch, an fp16 overflow, a tensor
the last rank never submits (warning, then StallError), and that shutdown
fails a pending handle and leaves no thread behind.
"""
import threading

import numpy as np
from mpi4py import MPI

import allreduce as ar

world = MPI.COMM_WORLD
ar.init(stall_check_time=0.3, stall_shutdown_time=1.5)
p, me = ar.size(), ar.rank()
last = p - 1


def expect(handle, error, *fragments):
    try:
        handle.wait(60)
    except error as exc:
        text = str(exc)
        assert all(f in text for f in fragments), text
        texts = world.allgather(text)
        assert all(t == texts[0] for t in texts), f"messages differ across ranks: {texts}"
        return
    raise AssertionError(f"{handle.name}: expected {error.__name__}")


# 1. Mismatch: rank 1 submits another shape; the other tensor in flight still succeeds.
bad = ar.allreduce_async(np.ones(5 if me == 1 else 4, np.float32), name="bad", op=ar.Sum)
good = ar.allreduce_async(np.full(3, me, np.float64), name="good", op=ar.Sum)
expect(bad, ar.MismatchError, "'bad'", "shape differs", "rank 0: (4,)", "rank 1: (5,)")
assert good.wait(60).tolist() == [p * (p - 1) / 2] * 3

# 2. fp16 overflow on rank 1 only: CompressionError naming rank 1, everywhere.
x = np.ones(6, np.float32)
if me == 1:
    x[2] = 1e9
h = ar.allreduce_async(x, name="overflow", compression=ar.Compression.fp16)
fine = ar.allreduce_async(np.ones(6, np.float32), name="fine", compression=ar.Compression.fp16)
expect(h, ar.CompressionError, "'overflow'", "rank(s) 1 ")
assert fine.wait(60).tolist() == [1.0] * 6

# 3. A tensor the last rank never submits: the others get StallError naming it.
if me != last:
    stalled = ar.allreduce_async(np.ones(2), name="lonely")
after = ar.allreduce(np.full(2, 1.0), name="after", op=ar.Sum)   # unaffected
assert after.tolist() == [p, p]
if me != last:
    try:
        stalled.wait(60)
        raise AssertionError("expected StallError")
    except ar.StallError as exc:
        assert "'lonely'" in str(exc) and f"never by rank(s) {last}." in str(exc), str(exc)
world.Barrier()

# 4. Shutdown fails what is pending and leaves no thread behind.
pending = ar.allreduce_async(np.ones(2), name=f"only-rank-{me}")
ar.shutdown()
try:
    pending.wait(60)
    raise AssertionError("expected ShutdownError")
except ar.ShutdownError:
    pass
alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
assert not alive, f"threads left after shutdown: {alive}"
try:
    ar.allreduce_async(np.ones(2), name="late")
    raise AssertionError("expected NotInitializedError")
except ar.NotInitializedError:
    pass
print(f"OK engine_errors rank {me} of {p}")
