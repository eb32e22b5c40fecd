"""Rank script: comm hooks under mpirun, bitwise identical on every rank, against MPI_Allreduce.

Run by tests/test_engine_hooks_mpi.py as ``mpirun -np P python hooks_check.py``. Each rank
submits its own gradients in its own random order for a few steps through PowerSGD (rank 2,
compressing from the second step), OneBit and a full-rank PowerSGD; every result must be the
same bytes on every rank (allgathered and compared), and the full-rank one MPI's average to
float32 rounding. Then rank-dependent hook settings, and a hook reset on rank 0 only, must raise
MismatchError on every rank.
"""
import numpy as np
from mpi4py import MPI

import allreduce as ar

world = MPI.COMM_WORLD
ar.init()
p, me = ar.size(), ar.rank()
rng = np.random.default_rng(100 + me)                 # each rank its own gradients and order
shapes = {"conv": (3, 3, 8, 16), "dense": (64, 32), "bias": (32,), "tiny": (2, 2)}
hooks = {"powersgd": ar.PowerSGD(rank=2, start_iter=1), "onebit": ar.OneBit(),
         "full": ar.PowerSGD(rank=64, start_iter=0, min_compression_rate=0)}


def same_everywhere(x: np.ndarray, what: str) -> None:
    blobs = world.allgather(x.tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what}: results differ bitwise across ranks"


for step in range(4):
    grads = {f"{kind}/{n}": rng.standard_normal(s).astype(np.float32) for kind in hooks for n, s in shapes.items()}
    order = list(grads)
    rng.shuffle(order)
    handles = {n: ar.allreduce_async(grads[n], name=n, comm_hook=hooks[n.split("/")[0]]) for n in order}
    for name in sorted(grads):
        got = handles[name].wait()
        same_everywhere(got, f"step {step} {name}")
        if name.startswith("full/"):
            want = np.empty_like(grads[name], dtype=np.float64)
            world.Allreduce(grads[name].astype(np.float64), want)
            scale = world.allreduce(float(np.abs(grads[name]).max())) * p
            assert np.abs(got - want / p).max() <= 1e-6 * scale, f"{name}: not the average"

# the public grouped call passes the hook through (each array its own tensor)
grouped = ar.grouped_allreduce([np.ones((8, 8), np.float32) * me, np.arange(5.0) * me], name="grp",
                               comm_hook=ar.PowerSGD(rank=1, start_iter=0, min_compression_rate=1))
for i, g in enumerate(grouped):
    same_everywhere(g, f"group {i}")
assert np.allclose(grouped[0], np.full((8, 8), (p - 1) / 2)), grouped[0]   # rank 1 all-equal: exact
assert np.array_equal(grouped[1], np.arange(5.0) * (p - 1) / 2)          # a vector: plain

try:
    ar.allreduce_async(np.ones((8, 8), np.float32), name="bad",
                       comm_hook=ar.PowerSGD(rank=1 + me % 2, start_iter=0)).wait()
    raise AssertionError("settings that differ must raise")
except ar.MismatchError as exc:
    assert "rank 0: PowerSGD(rank=1," in str(exc) and "rank 1: PowerSGD(rank=2," in str(exc), exc

# a reset on rank 0 only: MismatchError on every rank (before: PowerSGD's plain warm-up on rank 0
# against the others' low-rank P allreduce, a transport error or timeout)
if p > 1:
    if me == 0:
        hooks["powersgd"].reset()
    try:
        ar.allreduce_async(np.ones((64, 32), np.float32), name="powersgd/dense", comm_hook=hooks["powersgd"]).wait()
        raise AssertionError("a reset on one rank only must raise")
    except ar.MismatchError as exc:
        assert "rank 0: PowerSGD(rank=2, start_iter=1" in str(exc) and ", new state" in str(exc), exc
        assert "rank 1: PowerSGD(rank=2, start_iter=1" in str(exc) and "state from earlier steps" in str(exc), exc
ar.shutdown()
print(f"OK hooks_check rank {me} of {p}", flush=True)
