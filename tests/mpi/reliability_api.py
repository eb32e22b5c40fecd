"""Rank script: every call after ``ar.shutdown()`` raises NotInitializedError; ``ar.init()`` restarts.

Run by tests/test_reliability_engine.py as ``mpirun -np 2 python reliability_api.py``.
Complements tests/mpi/engine_errors.py (allreduce_async after shutdown,
pending handle fails with ShutdownError): here every entry point is tried,
a finished handle keeps its result, and a second init() works correctly.
"""
import numpy as np

import allreduce as ar

ar.init()
p, me = ar.size(), ar.rank()
done = ar.allreduce_async(np.full(3, me + 1.0), name="before", op=ar.Sum)
assert done.wait(60).tolist() == [p * (p + 1) / 2] * 3
ar.shutdown()
ar.shutdown()                                                  # idempotent

calls = {
    "allreduce_async": lambda: ar.allreduce_async(np.ones(2), name="x"),
    "grouped_allreduce": lambda: ar.grouped_allreduce([np.ones(2)] * 2, name="g"),
    "allreduce(name=)": lambda: ar.allreduce(np.ones(2), name="x"),
    "allreduce(compression=)": lambda: ar.allreduce(np.ones(2), compression=ar.Compression.fp16),
    "allreduce": lambda: ar.allreduce(np.ones(2)),
    "allreduce_": lambda: ar.allreduce_(np.ones(2)),
    "broadcast": lambda: ar.broadcast(np.ones(2), 0),
    "barrier": ar.barrier,
    "rank": ar.rank,
}
for what, call in calls.items():
    try:
        call()
    except ar.NotInitializedError as exc:
        assert "ar.init()" in str(exc), f"{what}: {exc}"
    else:
        raise AssertionError(f"{what} after shutdown did not raise NotInitializedError")
assert ar.synchronize(done).tolist() == [p * (p + 1) / 2] * 3   # a finished handle keeps its result

ar.init()                                                      # a restart works
got = ar.grouped_allreduce([np.full(4, me, np.int64), np.full(2, 1.0, np.float32)], name="again", op=ar.Sum)
assert got[0].tolist() == [p * (p - 1) // 2] * 4 and got[1].tolist() == [float(p)] * 2, got
assert ar.allreduce(np.ones(3), op=ar.Sum).tolist() == [float(p)] * 3
ar.shutdown()
print(f"OK reliability_api rank {me}")
