"""Rank script: ``ar.join()`` for uneven data and ``op=ar.Adasum``, through the public API under MPI.

Run by tests/test_join_adasum_mpi.py at -np 2 and 3. Checks, on every rank:

1. rank r runs 3 + r steps (a named Average, a grouped Sum, an unnamed-order int Sum), then
   joins; every result equals the numpy reference (Average divides by the full size, joined
   ranks contributing zeros) and is bitwise the same on every rank that computed it; join()
   returns the last rank on every rank;
2. a second round: rank 0 joins at once; the others reduce, then allgather, broadcast and
   alltoall raise MismatchError (a rank is joined), then join (every rank gets the same last rank);
3. Adasum: at a power-of-two size the direct and the engine path equal the float64 reference of
   the same tree and agree bitwise across ranks; elsewhere every rank raises, naming the size.
Prints "rank R: join_check OK".
"""
import re

import numpy as np

import allreduce as ar
from allreduce.algorithms import adasum
from allreduce.errors import InvalidArgumentError, MismatchError

ar.init()
p, me = ar.size(), ar.rank()


def data(r, step, n=6, dtype=np.float32):
    return (np.arange(n) % 5 + 2 * r + step).astype(dtype)


# 1. uneven steps, then join
results = []
for step in range(3 + me):
    avg = ar.allreduce(data(me, step), name=f"avg.{step}")
    group = ar.grouped_allreduce([data(me, step, 3), data(me, step, 4, np.float64)], name=f"grp.{step}", op=ar.Sum)
    ints = ar.allreduce(data(me, step, 5, np.int64), name=f"int.{step}", op=ar.Sum)
    results.append((avg, *group, ints))
last = ar.join()
assert last == p - 1, f"rank {me}: join returned {last}, expected {p - 1}"
everyone = ar.allgather_object(results)               # every rank has joined: allowed again
for step in range(3 + p - 1):
    active = [r for r in range(p) if step < 3 + r]
    want = (sum(data(r, step).astype(np.float64) for r in active) / p,
            sum(data(r, step, 3) for r in active), sum(data(r, step, 4, np.float64) for r in active),
            sum(data(r, step, 5, np.int64) for r in active))
    for r in active:
        got = everyone[r][step]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"rank {r} step {step}")
        for g, first in zip(got, everyone[p - 1][step]):
            assert g.tobytes() == first.tobytes(), f"rank {r} step {step}: not bitwise the rank {p - 1}'s"

# 2. a second round: rank 0 joins at once; the others cannot allgather, broadcast or alltoall
if me == 0:
    last = ar.join()
else:
    s = ar.allreduce(np.ones(3), name="round2", op=ar.Sum)    # done: rank 0's join is known here
    assert np.array_equal(s, np.full(3, p - 1.0)), s
    for what, call in [("allgather", lambda: ar.allgather(np.ones(2))),
                       ("broadcast", lambda: ar.broadcast(np.ones(2), root_rank=1)),
                       ("alltoall", lambda: ar.alltoall(np.ones(p))),
                       ("broadcast_object", lambda: ar.broadcast_object("x", root_rank=1))]:
        try:
            call()
            raise AssertionError(f"rank {me}: {what} did not raise while rank 0 is joined")
        except MismatchError as exc:
            # rank 0 has joined; a faster other rank may have finished these calls and joined too
            assert re.search(rf"{what} is not supported while rank\(s\) 0(, \d+)* have joined", str(exc)), exc
    last = ar.join()
lasts = ar.allgather_object(last)                 # ranks 1.. may join in any order: the same answer
assert lasts == [lasts[0]] * p and 1 <= lasts[0] < p, f"round 2 joins returned {lasts}"

# 3. Adasum
rng = np.random.default_rng(11)
inputs = [rng.standard_normal(1001).astype(np.float32) + 0.2 * r for r in range(p)]
if p & (p - 1) == 0:
    ref = adasum.reference(inputs)
    direct = ar.allreduce(inputs[me], op=ar.Adasum)
    engine = ar.allreduce(inputs[me], op=ar.Adasum, name="ada")
    grouped = ar.grouped_allreduce([inputs[me][:10], inputs[me]], op=ar.Adasum, name="adag")
    for got in (direct, engine, grouped[1]):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grouped[0], adasum.reference([x[:10] for x in inputs]), rtol=1e-5, atol=1e-6)
    gathered = ar.allgather_object((direct.tobytes(), engine.tobytes()))
    assert all(g == gathered[0] for g in gathered), "Adasum results differ across ranks"
else:
    for call in (lambda: ar.allreduce(inputs[me], op=ar.Adasum),
                 lambda: ar.allreduce(inputs[me], op=ar.Adasum, name="ada")):
        try:
            call()
            raise AssertionError(f"rank {me}: Adasum at p = {p} did not raise")
        except InvalidArgumentError as exc:
            assert f"rank {me}: Adasum needs a power-of-two number of ranks" in str(exc) and f"has {p}" in str(exc)
ar.barrier()
print(f"rank {me}: join_check OK", flush=True)
ar.shutdown()
