"""Rank script: a soak of the engine - many random named allreduces, each checked, memory flat.

    allreduce-run -np 3 python tests/mpi/soak.py                 # 10^5 ops (tests/test_soak.py)
    allreduce-run -np 3 python tests/mpi/soak.py --ops 1000000 --report 50   # the long soak

A family is a (dtype, op, fp16 compression or not): every supported dtype
with every op it accepts (11 dtypes x 5 ops, less bool's Average) plus fp16
on float32/float64 for Sum/Average, 58 in all. Each family owns
``--per-step // 58`` names (34 by default). Every step, every rank submits
every name once, each rank in its own random order: one random family per
step through ``grouped_allreduce``, the rest one by one through
``allreduce_async``, then waits in another random order. Sizes are random
(0 to 40 elements, 5% of them 41 to 3000); 90% of the names keep their
size for the whole run (the response cache's fast path), 10% draw a new
size every step (their metadata changes: cache eviction and the slow
path). Small tensors, many per step: fusion makes 10^5 operations cheap.

Inputs are ``a + rank * b`` for small integers ``a``, ``b`` drawn from a
seed every rank shares, so each rank knows every rank's input and checks
each result against ``allreduce_reference``: exactly for uncompressed
tensors (every value and sum is a small integer), within the fp16 bound
for compressed ones. One digest per step proves the ranks agree bitwise.

Memory: VmRSS (``/proc/self/status``) after every step; after the warm-up
(the first 20% of steps) it must stay within ``--rss-bound-mib`` of its
value at the end of the warm-up. Prints one ``OK soak`` line per rank.
"""
import argparse
import hashlib
import sys
import time

import numpy as np

import allreduce as ar
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import SUPPORTED_DTYPES, Op

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--ops", type=int, default=100_000, help="tensor allreduces in total (per rank)")
parser.add_argument("--per-step", type=int, default=2000, help="tensors per step")
parser.add_argument("--families", type=int, default=0, help="(dtype, op, compression) families per step (0: all 58)")
parser.add_argument("--volatile", type=float, default=0.1,
                    help="fraction of each family's names whose size changes every step (cache evictions)")
parser.add_argument("--rss-bound-mib", type=float, default=20.0, help="allowed VmRSS growth after warm-up")
parser.add_argument("--report", type=int, default=0, help="print a progress line every N steps (0: off)")
parser.add_argument("--cycle-ms", type=float, default=2.0,
                    help="engine cycle (milliseconds)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

# A family fixes (dtype, op, fp16 compression); every name belongs to one family.
FAMILIES = [(np.dtype(d), op, False) for d in SUPPORTED_DTYPES for op in Op
            if not (np.dtype(d).kind == "b" and op == Op.AVERAGE)] + \
           [(np.dtype(d), op, True) for d in (np.float32, np.float64) for op in (Op.SUM, Op.AVERAGE)]
args.families = args.families or len(FAMILIES)
PER_FAMILY = args.per_step // args.families
ar.init(cycle_time=args.cycle_ms, cache_capacity=2 * len(FAMILIES) * PER_FAMILY)
p, me = ar.size(), ar.rank()
STABLE = PER_FAMILY - int(args.volatile * PER_FAMILY)   # names whose size never changes: the fast path
FP16_BOUND = (p + 1) * 2.0 ** -11


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def draw_sizes(rng, n):
    """0 to 40 elements, 5% of them 41 to 3000."""
    small, big = rng.integers(0, 41, n), rng.integers(41, 3001, n)
    return np.where(rng.random(n) < 0.05, big, small)


STABLE_SIZES = draw_sizes(np.random.default_rng([args.seed, 99]), len(FAMILIES) * STABLE).reshape(len(FAMILIES), -1)


def family_inputs(rng, family, sizes):
    """Every rank's pooled input ``a + r*b``: small integers that every dtype holds exactly."""
    dtype, op, _ = family
    total = int(sizes.sum())
    if op == Op.PRODUCT:
        a, b = rng.integers(-2, 3, total), np.zeros(total, np.int64)
    else:
        a, b = rng.integers(-8, 9, total), rng.integers(-4, 5, total)
    if dtype.kind == "u":
        a, b = np.abs(a), np.abs(b)
    return [(a + r * b).astype(dtype) for r in range(p)]


def check(what, got, xs, family):
    dtype, op, compressed = family
    want = allreduce_reference(xs, op)
    assert got.dtype == dtype, f"{what}: got {got.dtype}"
    if not compressed:
        bad = np.flatnonzero(got != want) if got.size else []
        assert len(bad) == 0, f"{what} {op!r} {dtype}: element {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
        return
    bound = FP16_BOUND * np.abs(np.stack(xs).astype(np.float64)).sum(0)
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound + 1e-12), f"{what}: fp16 error too large"


def step(s):
    shared = np.random.default_rng([args.seed, s, 1])     # the same on every rank
    mine = np.random.default_rng([args.seed, s, 2, me])    # this rank's submission and wait order
    chosen = shared.choice(len(FAMILIES), args.families, replace=False)
    work = []                                             # (family id, family, names, sizes, inputs)
    for f in chosen:
        sizes = np.concatenate([STABLE_SIZES[f], draw_sizes(shared, PER_FAMILY - STABLE)])
        work.append((f, FAMILIES[f], [f"f{f}/t{i}" for i in range(PER_FAMILY)], sizes,
                     family_inputs(shared, FAMILIES[f], sizes)))
    offsets = [np.concatenate([[0], np.cumsum(w[3])]) for w in work]
    # Family 0 of the step goes through grouped_allreduce (one op per call); the rest one by one.
    handles = {}
    for k in range(1, len(work)):
        f, (dtype, op, compressed), names, _, xs = work[k]
        for i in mine.permutation(len(names)):
            x = xs[me][offsets[k][i]:offsets[k][i + 1]]
            handles[k, i] = ar.allreduce_async(x, name=names[i], op=op,
                                               compression=ar.Compression.fp16 if compressed else None)
    f, family, names, _, xs = work[0]
    parts = [xs[me][offsets[0][i]:offsets[0][i + 1]] for i in range(len(names))]
    results = {0: ar.grouped_allreduce(parts, name=f"g{f}", op=family[1],
                                       compression=ar.Compression.fp16 if family[2] else None)}
    for k in range(1, len(work)):
        results[k] = [None] * len(work[k][2])
    keys = list(handles)
    for j in mine.permutation(len(keys)):
        results[keys[j][0]][keys[j][1]] = ar.synchronize(handles[keys[j]])
    digest = hashlib.sha1()
    for k, (f, family, names, sizes, xs) in enumerate(work):
        assert all(r.shape == (n,) for r, n in zip(results[k], sizes)), f"family {f}: wrong shapes"
        got = np.concatenate(results[k]) if results[k] else np.zeros(0, family[0])
        check(f"step {s} family {f} {names[0]}..", got, xs, family)
        digest.update(got.tobytes())
    digests = ar.allgather_object(digest.hexdigest())
    assert len(set(digests)) == 1, f"step {s}: ranks differ bitwise"
    return sum(len(w[2]) for w in work)


steps = -(-args.ops // (PER_FAMILY * args.families))
warmup = max(2, steps // 5)
start, ops, rss_base, rss_max = time.monotonic(), 0, None, 0.0
for s in range(steps):
    ops += step(s)
    rss = rss_mib()
    if s + 1 == warmup:
        rss_base = rss
    elif rss_base is not None:
        rss_max = max(rss_max, rss)
    if args.report and me == 0 and (s + 1) % args.report == 0:
        print(f"soak step {s + 1}/{steps}: {ops} ops, {time.monotonic() - start:.0f} s, VmRSS {rss:.1f} MiB",
              flush=True)
elapsed = time.monotonic() - start
growth = max(0.0, rss_max - rss_base)
rows = ar.allgather_object((me, ops, rss_base, rss_max, growth))
if me == 0:
    print(f"soak: {p} ranks, {steps} steps x {PER_FAMILY * args.families} tensors, {elapsed:.1f} s, "
          f"{ops / elapsed:.0f} ops/s per rank (command: {' '.join(sys.argv)})")
    print("rank   ops   VmRSS after warm-up (MiB)   max after (MiB)   growth (MiB)")
    for r, n, base, top, grow in rows:
        print(f"{r:>4} {n:>7} {base:>27.1f} {top:>17.1f} {grow:>14.1f}")
ar.shutdown()
assert growth <= args.rss_bound_mib, f"rank {me}: VmRSS grew {growth:.1f} MiB after warm-up"
print(f"OK soak rank {me}: {ops} ops checked, VmRSS growth {growth:.1f} MiB after warm-up", flush=True)
