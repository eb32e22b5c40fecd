"""Rank script: the engine times a direct batch's two ways (shm's many-call, rhd per array), keeps one.

Run by tests/test_engine_mpi.py as ``mpirun -np P python engine_batch_tune.py [--no-tune]``. The
same three large tensors (a training step's gradients) are reduced step after step, each step's
results checked against the float64 reference and, every 25 steps, bitwise across ranks. A batch
is tuned by its array count, bytes and dtype; the three tensors may meet in one batch or split
into two, so several batches can be in tuning at once. Once one batch has settled: both ways ran,
every rank keeps the same way for it, and each later call of that batch runs it. ``--no-tune``
(run with ALLREDUCE_AUTOTUNE=0): nothing is timed, every batch is one many-call. Both: a lone
large tensor (not in place) is one many-call too, its result exact.
"""
import hashlib
import sys

import numpy as np

import allreduce as ar
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import Op
from allreduce.transport.mpi import MPI                   # MPI starts with the library's defaults

tune = "--no-tune" not in sys.argv
world = MPI.COMM_WORLD
ar.init()
p, me = ar.size(), ar.rank()
reducer = ar.api._running_engine().reducer
assert reducer.tunes == tune, (reducer.tunes, tune)
ran = []                                                  # (step, batch, way) of every direct batch
real = reducer._run_batch


def spy(choice, bufs, *rest):
    ran.append((steps, (len(bufs), sum(b.nbytes for b in bufs), bufs[0].dtype.str), choice))
    return real(choice, bufs, *rest)


reducer._run_batch = spy
SIZES = (1_000_000, 900_001, 800_003)                     # float32: each a direct tensor
OPS = (Op.SUM, Op.AVERAGE)
rng = np.random.default_rng(0)
xs = [[rng.integers(-50, 50, n).astype(np.float32) for _ in range(p)] for n in SIZES]
want = {op: [allreduce_reference(x, op).tobytes() for x in xs] for op in OPS}
steps, settled_at = 0, None
while steps < (1500 if tune else 40) and (settled_at is None or steps < settled_at + 20):
    op = OPS[steps % 2]
    mine = [x[me].copy() for x in xs]
    results = [h.wait() for h in [ar.allreduce_async_(m, name=f"grad.{i}", op=op) for i, m in enumerate(mine)]]
    assert [r.tobytes() for r in results] == want[op], f"step {steps}: wrong result"
    if steps % 25 == 0:
        digest = hashlib.sha1(b"".join(r.tobytes() for r in results)).hexdigest()
        assert len(set(world.allgather(digest))) == 1, f"step {steps}: ranks differ bitwise"
    steps += 1
    if settled_at is None and reducer.batch_picks:
        settled_at = steps
# A lone large tensor (tfops' eager allreduce of one tensor) takes the many-call too, reading its
# input where it lies (reducer.LONE_MANY_BYTES), tuned or not.
lone, real_many = [], ar.algorithms.run_many
ar.algorithms.run_many = lambda name, comm, bufs, *a, **k: (lone.append((name, len(bufs))), real_many(name, comm, bufs, *a, **k))[1]
got = ar.allreduce_async(xs[0][me], name="lone", op=Op.SUM).wait()
ar.algorithms.run_many = real_many
assert got.tobytes() == want[Op.SUM][0] and lone == [(reducer.many, 1)] and reducer.many == "shm", lone
ar.shutdown()
picks = world.allgather(dict(reducer.batch_picks))
if tune:
    assert settled_at is not None, f"no batch settled in {steps} steps: {sorted(set(ran))[:6]}"
    assert all(q == picks[0] for q in picks), f"ranks kept different ways: {picks}"
    for batch, kept in picks[0].items():
        tried = {way for _, b, way in ran if b == batch}
        assert tried == {"many", "each"}, f"batch {batch}: both ways must be timed, ran {tried}"
        last = [way for step, b, way in ran if b == batch and step >= settled_at]
        assert last and set(last) == {kept}, f"batch {batch} kept {kept} but ran {set(last)} afterwards"
    if me == 0:
        print(f"OK engine_batch_tune: {steps} steps on {p} ranks, settled after {settled_at}, "
              f"kept {sorted(picks[0].values())}")
else:
    assert {way for _, _, way in ran} <= {"many"} and not picks[0], (ran[:4], picks[0])
    if me == 0:
        print(f"OK engine_batch_tune: {steps} steps on {p} ranks, untuned")
