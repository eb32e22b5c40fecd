"""Allreduce across the namespace cluster: flat algorithms, hierarchical and auto; fp16 against fp32.

::

    allreduce-cluster up --nodes 2 --link 1gbit --slots 2
    allreduce-run --cluster -np 4 python benchmarks/cluster_bench.py [SIZES_MIB...] [--json out.json]

For each size: the best of ``REPEATS`` blocks per algorithm (each block one call from 4 MiB up,
up to ``BLOCK_CALLS`` below, after one warm-up call), times the slowest rank's, round-robin over
the algorithms. ``auto`` is timed once its tuner has kept
a pick for the size (at most ``SETTLE_CALLS`` calls before: what a training loop, which calls
the same sizes thousands of times, runs), and the line under the table says what it kept.
Then the engine's fp32 against fp16 (``Compression.fp16``), and against float32 of half the
elements (``eng n/2``: fp16's bytes without its casts and half-precision sums, what compression
could reach at best).

The link bound: one host's link of R bit/s (the link ``ar.init()`` measured or was given)
carries ``network.cross_terms``'s b bytes per byte: a flat ring 2(p-1)/p, hierarchical
2(H-1)/H over H hosts; so hierarchical's algbw is at most R / 8 / b.
"""
import json
import sys
import time

import numpy as np

import allreduce as ar
from allreduce.algorithms import network

REPEATS = 3
BLOCK_CALLS = 40      #: calls per timed block below 4 MiB (4 MiB / size, at most this many)
SETTLE_CALLS = 30000  #: tuning a small size can take seconds of calls: the tuner times again while
                      #: every contender runs 3x its model's prediction (a loaded machine)
FLAT = ["ring", "rhd", "rd", "tree", "mpi"]


def best(fns: dict, calls: int) -> dict:
    """Each function's best block mean (``calls`` calls a block) of REPEATS blocks after a warm-up
    call, round-robin over the functions; the slowest rank's."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(REPEATS):
        for name, fn in fns.items():
            ar.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    mine = [min(times[name]) for name in fns]
    return dict(zip(fns, np.max(ar.allgather_object(mine), axis=0).tolist()))


def settle(x: np.ndarray) -> tuple[str, int]:
    """Run ``auto`` on ``x`` until its pick for the size is kept (the same call on every rank)."""
    comm = ar.communicator()
    for calls in range(1, SETTLE_CALLS + 1):
        ar.allreduce(x, algorithm="auto")
        tuning = comm.tuner is not None and x.nbytes in comm.tuner.trials
        if x.nbytes in comm.auto_picks and not tuning:
            return comm.auto_picks[x.nbytes], calls
    return comm.auto_picks.get(x.nbytes, "?"), SETTLE_CALLS


def main() -> None:
    args = sys.argv[1:]
    out = args[args.index("--json") + 1] if "--json" in args else None
    sizes = [float(s) for s in args if s != out and s != "--json"] or [4, 16]
    ar.init()
    comm = ar.communicator()
    algos = FLAT + (["hierarchical"] if comm.local_size > 1 else []) + ["auto"]
    link = getattr(comm.transport, "link", None)
    p, hosts = ar.size(), comm.nodes
    if ar.rank() == 0:
        print(f"# allreduce-run --cluster -np {p} python benchmarks/cluster_bench.py {' '.join(args)}")
        print(f"# {p} ranks on {hosts} hosts (local_size {comm.local_size}); link {link or 'none (one node)'}")
        print(f"# float32, Sum; best of {REPEATS} blocks (4 MiB / size calls, 1..{BLOCK_CALLS}) after a warm-up, "
              f"round-robin, slowest rank; auto after its tuner "
              f"kept a pick; bound = hierarchical's link bound")
        print(f"{'MiB':>8} " + " ".join(f"{a:>12}" for a in algos)
              + f" {'bound':>8} {'eng fp32':>9} {'eng fp16':>9} {'eng n/2':>9}  (ms)", flush=True)
    rows = []
    for mib in sizes:
        x = np.ones(max(int(mib * (1 << 20)) // 4, 1), np.float32)
        kept, calls = settle(x)
        block = max(1, min(BLOCK_CALLS, (4 << 20) // x.nbytes))     # small calls: blocks of many
        t = best({a: (lambda a=a: ar.allreduce(x, algorithm=a)) for a in algos}, block)
        half = x[:max(x.size // 2, 1)].copy()           # fp16's bytes in float32: what compression could reach
        settle(half)                # fp16's wire size too: its engine calls would otherwise run auto's trials
        t.update(best({"eng fp32": lambda: ar.allreduce(x, name="b32"),
                       "eng fp16": lambda: ar.allreduce(x, name="b16", compression=ar.Compression.fp16),
                       "eng n/2": lambda: ar.allreduce(half, name="bhalf")}, block))
        b_net = network.cross_terms("hierarchical", p, hosts, x.nbytes)[1]
        bound = b_net * x.nbytes * link.beta if link is not None and hosts > 1 else 0.0
        fastest = min(FLAT + (["hierarchical"] if "hierarchical" in algos else []), key=t.__getitem__)
        rows.append({"mib": mib, "bytes": x.nbytes, "ms": {k: v * 1e3 for k, v in t.items()}, "auto_kept": kept,
                     "settle_calls": calls, "model_pick": comm.choose(x.nbytes), "best": fastest,
                     "bound_ms": bound * 1e3, "decided": comm.tuner.decided.get(x.nbytes) if comm.tuner else None})
        if ar.rank() == 0:
            print(f"{mib:8g} " + " ".join(f"{t[a] * 1e3:12.2f}" for a in algos)
                  + f" {bound * 1e3:8.2f} {t['eng fp32'] * 1e3:9.2f} {t['eng fp16'] * 1e3:9.2f}"
                  f" {t['eng n/2'] * 1e3:9.2f}", flush=True)
    if ar.rank() == 0:
        for r in rows:
            ms = r["ms"]
            print(f"# {r['mib']:g} MiB: auto kept {r['auto_kept']} after {r['settle_calls']} calls (model's pick "
                  f"{r['model_pick']}); auto / best ({r['best']}) = {ms['auto'] / ms[r['best']]:.2f}x"
                  + (f"; hierarchical / ring {ms['ring'] / ms['hierarchical']:.2f}x, "
                     f"{100 * r['bound_ms'] / ms['hierarchical']:.0f}% of the link bound"
                     if "hierarchical" in ms and r["bound_ms"] else "")
                  + f"; fp16 / fp32 {ms['eng fp32'] / ms['eng fp16']:.2f}x (half the bytes in float32: "
                    f"{ms['eng fp32'] / ms['eng n/2']:.2f}x)")
        if out:
            with open(out, "w") as f:
                json.dump({"ranks": p, "hosts": hosts, "local_size": comm.local_size,
                           "link": None if link is None else {"alpha": link.alpha, "beta": link.beta,
                                                               "source": link.source},
                           "rows": rows}, f, indent=1)
    ar.shutdown()


if __name__ == "__main__":
    main()
