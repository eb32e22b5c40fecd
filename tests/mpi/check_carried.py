"""The metadata check carried in messages (allreduce/algorithms/agree.py), under real MPI.

    mpirun -np 2 python tests/mpi/check_carried.py      # also at -np 3 (rd not carried) and 4

1. rd carrying the head (the mailbox), and every other vehicle (head-only swaps before the
   algorithm): every dtype and op, sizes 0 to the mailbox's limit and past it, in and out of
   place: results exact and bitwise equal on every rank.
2. Mismatches of every field (count, dtype, op, algorithm, root, registered memory, the call
   number), through each vehicle (rd carried, rd/ring/mpi/shm/auto after head-only
   swaps, broadcast's check), one rank differing from the others: MismatchError on every rank,
   naming every rank's value, the same text on every rank; then a correct allreduce.
3. A count mismatch where one rank's message fits the mailbox and the other's does not (one
   rank carries the head in its data message, the other sends it alone): no hang.
4. The default call (no ``algorithm=``, auto keeping rd: at p = 2 the communicator's fast path),
   every dtype and op, shapes () to (300,), strided: exact, bitwise equal;
   count, dtype, op, call number and algorithm mismatches raised on every rank; the default
   call on one rank and ``algorithm="auto"`` on another agree.
Prints ``OK check_carried on N ranks: ...`` from rank 0.
"""
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce.algorithms import agree
from allreduce.errors import MismatchError
from allreduce.ops import Op, bfloat16

sys.path.insert(0, str(Path(__file__).parent))
from rank_checks import check_result  # noqa: E402

c = ar.init(engine=False)
world = MPI.COMM_WORLD
me, p = c.rank, c.size
assert c.transport.mailbox is not None, "the test needs the mailbox (one node, shared memory)"
limit = c.transport.mailbox.limit
carried = agree.carries(c.transport, np.empty(8, np.float32), np.empty(8, np.float32))
VEHICLES = ["rd", "ring", "mpi", "shm", "auto"]


def abort(code):
    world.Abort(code)


# 1. results through every vehicle -------------------------------------------------------------
rng = np.random.default_rng(7)
results = 0
for dtype in (np.float32, np.float64, np.int32, bfloat16):
    for op in Op:
        for count in (0, 7, limit // np.dtype(dtype).itemsize, limit // np.dtype(dtype).itemsize + 3):
            xs = [rng.integers(-3, 4, count).astype(dtype) if op != Op.PRODUCT
                  else rng.choice([-1, 1, 2], count).astype(dtype) for _ in range(p)]
            for algorithm in ("rd", "auto") if count < 2000 else ("rd",):
                out = c.allreduce(xs[me], op, algorithm=algorithm)
                check_result(out, xs, op, me, f"allreduce {algorithm} {count}", abort)
                inplace = xs[me].copy()
                c.allreduce_(inplace, op, algorithm=algorithm)
                check_result(inplace, xs, op, me, f"allreduce_ {algorithm} {count}", abort)
                both = np.stack(world.allgather(out.view(np.uint8)))
                if (both != both[0]).any():
                    print(f"rank {me}: ranks differ bitwise, {algorithm} {count} {dtype} {op!r}", flush=True)
                    abort(1)
                results += 2

# 2. mismatches of every field through every vehicle -------------------------------------------
odd = p - 1                    # the rank that differs (p = 2: rank 1; p = 3: rank 2, which folds in rd)


def expect_mismatch(what, call, *needles, settle=None):
    """``call()`` must raise MismatchError on every rank, naming every rank's value, one text
    (``settle()`` then puts things right before the next, correct call)."""
    try:
        call()
    except MismatchError as exc:
        text = str(exc)
        if settle is not None:
            settle()
    else:
        print(f"rank {me}: no MismatchError for {what}", flush=True)
        abort(1)
    for needle in needles:
        if needle not in text:
            print(f"rank {me}: {what}: {needle!r} not in {text!r}", flush=True)
            abort(1)
    texts = world.allgather(text)
    if len(set(texts)) != 1:
        print(f"rank {me}: {what}: ranks raised different texts {texts}", flush=True)
        abort(1)
    x = np.full(5, me + 1.0, np.float32)            # still usable
    check_result(c.allreduce(x, Op.SUM), [np.full(5, r + 1.0, np.float32) for r in range(p)], Op.SUM, me,
                 f"after {what}", abort)


def ranks(values):
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


mismatches = 0
for algorithm in VEHICLES:
    small = 256                                     # fits the mailbox: rd carries the head
    n = [small] * p
    n[odd] = small + 3
    expect_mismatch(f"count {algorithm}", lambda: c.allreduce(np.ones(n[me], np.float32), algorithm=algorithm),
                    f"count differs across ranks ({ranks(n)})")
    dt = [np.float32] * p
    dt[odd] = np.float64
    expect_mismatch(f"dtype {algorithm}", lambda: c.allreduce(np.ones(small, dt[me]), algorithm=algorithm),
                    "dtype differs across ranks (" + ranks([np.dtype(d).name for d in dt]) + ")")
    ops = [Op.SUM] * p
    ops[odd] = Op.MAX
    expect_mismatch(f"op {algorithm}", lambda: c.allreduce(np.ones(small, np.float32), ops[me], algorithm=algorithm),
                    "op differs across ranks (" + ranks([repr(o) for o in ops]) + ")")
    other = "ring" if algorithm != "ring" else "rd"
    names = [algorithm] * p
    names[odd] = other
    expect_mismatch(f"algorithm {algorithm}",
                    lambda: c.allreduce(np.ones(small, np.float32), algorithm=names[me]),
                    f"algorithm differs across ranks ({ranks(names)})")
    calls = c._calls
    if me == odd:
        c._calls += 1                               # as if this rank had made one more checked call

    def settle():
        if me != odd:
            c._calls += 1                           # every rank counts alike again
    expect_mismatch(f"call number {algorithm}", lambda: c.allreduce(np.ones(small, np.float32), algorithm=algorithm),
                    "call differs across ranks (" + ranks([f"checked call {calls + (r == odd)}" for r in range(p)]) + ")",
                    settle=settle)
    mismatches += 5

roots = [0] * p
roots[odd] = 1
expect_mismatch("root", lambda: c.broadcast(np.ones(4), root_rank=roots[me]),
                f"root_rank differs across ranks ({ranks(roots)})")
reg = c.shared_empty(64, np.float32)
shared_or_not = [reg] * p
shared_or_not[odd] = np.ones(64, np.float32)
expect_mismatch("shared", lambda: c.allreduce_(shared_or_not[me], algorithm="shm"),
                "shared differs across ranks", f"rank {odd}: a private array")
mismatches += 2

# 3. one rank's message fits the mailbox, another's does not: no hang --------------------------
big = [limit // 4 - 16] * p
big[odd] = 4 * limit
start = time.perf_counter()
expect_mismatch("count across the mailbox limit", lambda: c.allreduce(np.ones(big[me], np.float32), algorithm="rd"),
                f"count differs across ranks ({ranks(big)})")
mismatches += 1

# 4. the default call (no algorithm=): at p = 2, where auto keeps rd, Communicator._pair_call ------
# Every size below is given auto's kept pick rd on every rank (what the tuner ends with here).
def default_call(x, op=Op.SUM):
    c.auto_picks[x.nbytes] = "rd"
    return c.allreduce(x, op)


for dtype in (np.float32, np.float64, np.int32, bfloat16, np.bool_):
    for op in Op:
        if dtype == np.bool_ and op == Op.AVERAGE:
            continue
        for shape in ((), (1,), (7,), (3, 5), (300,)):
            xs = [(rng.integers(-3, 4, shape) if op != Op.PRODUCT else rng.choice([-1, 1, 2], shape)).astype(dtype)
                  for _ in range(p)]
            if op == Op.ADASUM:
                break
            out = default_call(xs[me], op)
            check_result(out, xs, op, me, f"default call {shape}", abort)
            both = np.stack(world.allgather(out.reshape(-1).view(np.uint8)))
            if out.shape != shape or (both != both[0]).any():
                print(f"rank {me}: default call {shape} {dtype} {op!r}: shape {out.shape} or ranks differ", flush=True)
                abort(1)
            results += 1
c.auto_picks[16] = "rd"
if (c._box is not None) != (p == 2) or (p == 2 and c._pair_call(np.ones(4, np.float32), Op.SUM) is None):
    print(f"rank {me}: the default call's fast path is {'not ' if p == 2 else ''}there at p = {p}", flush=True)
    abort(1)                                        # (_pair_call: a real call, on every rank)
strided = np.arange(40, dtype=np.float32)[::3]
check_result(default_call(strided), [strided] * p, Op.SUM, me, "default call, strided input", abort)
small = 64
n = [small] * p
n[odd] = small + 3
expect_mismatch("count, default call", lambda: default_call(np.ones(n[me], np.float32)),
                f"count differs across ranks ({ranks(n)})")
dt = [np.float32] * p
dt[odd] = np.int32
expect_mismatch("dtype, default call", lambda: default_call(np.ones(small, dt[me])),
                "dtype differs across ranks (" + ranks([np.dtype(d).name for d in dt]) + ")")
ops = [Op.SUM] * p
ops[odd] = Op.MIN
expect_mismatch("op, default call", lambda: default_call(np.ones(small, np.float32), ops[me]),
                "op differs across ranks (" + ranks([repr(o) for o in ops]) + ")")
calls = c._calls
if me == odd:
    c._calls += 1


def settle():
    if me != odd:
        c._calls += 1


expect_mismatch("call number, default call", lambda: default_call(np.ones(small, np.float32)),
                "call differs across ranks (" + ranks([f"checked call {calls + (r == odd)}" for r in range(p)]) + ")",
                settle=settle)
names = ["auto"] * p                                # the default call meets algorithm="rd" on one rank
names[odd] = "rd"
expect_mismatch("algorithm, default call", lambda: c.allreduce(np.ones(small, np.float32), Op.SUM, algorithm=names[me])
                if me == odd else default_call(np.ones(small, np.float32)), f"algorithm differs across ranks ({ranks(names)})")
mismatches += 5
# 5. out of step: one rank calls another collective (it skipped one): every checked collective's
#    head names its kind, so they meet in the first swap and fail at once, naming each rank's call
other = {"allgather": lambda: c.allgather(np.ones(3, np.float32)),
         "broadcast": lambda: c.broadcast(np.ones(3, np.float32), root_rank=0),
         "allgather_object": lambda: c.allgather_object(me),
         "broadcast_object": lambda: c.broadcast_object(me, root_rank=0),
         "reducescatter": lambda: c.reducescatter(np.ones(3 * p, np.float32)),
         "alltoall": lambda: c.alltoall(np.ones(p, np.float32)),
         "barrier": c.barrier}
on_odd = {"allreduce (rd carrying)": lambda: c.allreduce(np.ones(small, np.float32), Op.SUM, algorithm="rd"),
          "allreduce (default call)": lambda: default_call(np.ones(small, np.float32)),
          "allreduce (mpi)": lambda: c.allreduce(np.ones(small, np.float32), Op.SUM, algorithm="mpi")}
start = time.perf_counter()
for kind, call in other.items():
    for odd_kind, odd_call in list(on_odd.items()) + [("broadcast", other["broadcast"])] * (kind == "allgather"):
        shown = ranks([odd_kind.split(" ")[0] if r == odd else kind for r in range(p)])
        expect_mismatch(f"out of step: {kind} against {odd_kind}", odd_call if me == odd else call,
                        f"the ranks are out of step: they call different collectives ({shown})")
        mismatches += 1
oos_seconds = time.perf_counter() - start
x = np.full(small, me + 1.0, np.float32)            # the default call on some ranks, auto spelled out on others
got = default_call(x) if me != odd else c.allreduce(x, Op.SUM, algorithm="auto")
check_result(got, [np.full(small, r + 1.0, np.float32) for r in range(p)], Op.SUM, me, "default call and auto", abort)
if me == 0:
    print(f"OK check_carried on {p} ranks: {results} results exact and equal across ranks, {mismatches} "
          f"mismatches raised on every rank (rd carries the head: {carried}), "
          f"{oos_seconds:.2f} s for the out-of-step pairs", flush=True)
ar.shutdown()
