"""Rank script: the engine under mpirun, every rank submitting in its own random order.

Run by tests/test_engine_mpi.py as ``mpirun -np P python engine_stress.py STEPS THRESHOLD``.
Every rank builds every rank's inputs from one shared seed, checks its
results against the float64 reference and that all ranks agree bitwise.
"""
import hashlib
import sys
import threading

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.kernels.reference import allreduce_reference, tolerance
from allreduce.ops import SUPPORTED_DTYPES, Op

steps, threshold = int(sys.argv[1]), int(sys.argv[2])
world = MPI.COMM_WORLD
ar.init(fusion_threshold=threshold)
p, me = ar.size(), ar.rank()
assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
SIZES = [0, 1, 3, 100, 1001, 4099, 30000]
# Every dtype and every op; 3i mod 5 (not i mod 5) so float32 (i = 2) draws Average whatever
# the number of dtypes: the fp16 step then has a tensor to compress (the timeline's COMPRESS).
NAMES = [(f"t{i}", SUPPORTED_DTYPES[i % len(SUPPORTED_DTYPES)], SIZES[i % len(SIZES)], list(Op)[3 * i % len(Op)])
         for i in range(20)]
assert not any(np.dtype(dt).kind == "b" and op == Op.AVERAGE for _, dt, _, op in NAMES)


def inputs_for(rng, count, dtype, op):
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(0 if op == Op.PRODUCT else -20, 3 if op == Op.PRODUCT else 20, count)
                .astype(dtype) for _ in range(p)]
    lo = 0.5 if op == Op.PRODUCT else -4
    return [rng.uniform(lo, 1.5 if op == Op.PRODUCT else 4, count).astype(dtype) for _ in range(p)]


def same_everywhere(results):
    """One allgather per step: every rank's digest of every result must be equal."""
    mine = {name: hashlib.sha1(res.tobytes()).hexdigest() for name, res in results.items()}
    for other in world.allgather(mine):
        bad = [name for name in mine if other[name] != mine[name]]
        assert not bad, f"ranks differ bitwise in {bad}"


def check(name, got, xs, op, comp=None):
    want = allreduce_reference(xs, op).astype(np.float64)
    got = got.astype(np.float64)
    if comp is not None:
        tol = (p + 1) * 2.0 ** -11 * np.abs(np.stack(xs).astype(np.float64)).sum(0)
        assert np.all(np.abs(got - want) <= tol), f"{name}: fp16 error too large"
        return
    rel = tolerance(xs[0].dtype, p, op)
    scale = np.abs(np.stack(xs).astype(np.float64)).sum(0) + np.abs(want)
    assert np.all(np.abs(got - want) <= rel * scale), f"{name} {op!r}: {got[:4]} vs {want[:4]}"


total = 0
for step in range(steps):
    shared = np.random.default_rng(step)                  # the same on every rank
    mine = np.random.default_rng([step, me])               # this rank's submission order
    tensors = {name: (inputs_for(shared, n, dt, op), op) for name, dt, n, op in NAMES}
    order = mine.permutation(len(NAMES))
    mode = step % 3
    if mode == 0:                                          # async handles, random order; in place every other time
        start = ar.allreduce_async_ if step % 2 else ar.allreduce_async
        mine_in = {name: tensors[name][0][me].copy() for name, *_ in NAMES}
        handles = {NAMES[i][0]: start(mine_in[NAMES[i][0]], name=NAMES[i][0], op=tensors[NAMES[i][0]][1])
                   for i in order}
        results = {name: ar.synchronize(h) for name, h in handles.items()}
        if step % 2:
            assert all(results[name] is mine_in[name] for name in results), "in place: the caller's arrays"
    elif mode == 1:                                        # fp16 on the floats, async
        results = {}
        comp = {name: ar.Compression.fp16 if np.dtype(dt) == np.float32 and op in (Op.SUM, Op.AVERAGE)
                else ar.Compression.none for name, dt, n, op in NAMES}
        handles = {NAMES[i][0]: ar.allreduce_async(tensors[NAMES[i][0]][0][me], name=NAMES[i][0],
                                                   op=tensors[NAMES[i][0]][1], compression=comp[NAMES[i][0]])
                   for i in order}
        for name, h in handles.items():
            results[name] = h.wait()
    else:                                                  # grouped (same order), then blocking named
        group = [n for n, dt, c, op in NAMES if op == Op.SUM]
        got = ar.grouped_allreduce([tensors[n][0][me] for n in group], name=f"grp{step % 2}", op=Op.SUM)
        results = dict(zip(group, got))
        results.update({n: ar.allreduce(tensors[n][0][me], op=tensors[n][1], name=n)
                        for n, *_ in NAMES if n not in results})
    same_everywhere(results)
    for name in sorted(results):
        res, (xs, op) = results[name], tensors[name]
        compressed = mode == 1 and np.dtype(xs[0].dtype) == np.float32 and op in (Op.SUM, Op.AVERAGE)
        check(name, res, xs, op, "fp16" if compressed else None)
        total += 1

stats = ar.api._engine.negotiator.stats
ar.shutdown()
alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
assert not alive, f"threads left after shutdown: {alive}"
if me == 0:
    print(f"OK engine_stress: {total} allreduces on {p} ranks, {steps} steps, threshold {threshold}, "
          f"exchanges {stats}")
