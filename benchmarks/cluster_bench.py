"""Allreduce across the namespace cluster: flat algorithms against hierarchical, fp16 against fp32.

::

    allreduce-cluster up --nodes 2 --link 1gbit --slots 2
    allreduce-run --cluster -np 4 python benchmarks/cluster_bench.py [SIZES_MIB...]

For each size: busbw-style table of the best of ``REPEATS`` calls per algorithm (each after one
warm-up call), then the engine's fp32 against fp16 (``Compression.fp16``). Times are the slowest
rank's. The link bound for one host's link of R bit/s: a flat ring sends 2(p-1)/p bytes per byte
from the host at the ring's cut, hierarchical 2(H-1)/H over H hosts.
"""
import sys
import time

import numpy as np

import allreduce as ar

REPEATS = 3
ALGOS = ["ring", "rhd", "mpi", "hierarchical", "auto"]


def best(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        ar.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return max(ar.allgather_object(min(times)))


def main() -> None:
    ar.init()
    sizes = [float(s) for s in sys.argv[1:]] or [4, 16]
    if ar.rank() == 0:
        print(f"# allreduce-run --cluster -np {ar.size()} python benchmarks/cluster_bench.py "
              f"{' '.join(sys.argv[1:])}")
        print(f"# {ar.size()} ranks, local_size {ar.local_size()}; float32, Sum; best of {REPEATS}, slowest rank")
        print(f"{'MiB':>6} " + " ".join(f"{a:>13}" for a in ALGOS) + f" {'eng fp32':>10} {'eng fp16':>10}  (ms)")
    for mib in sizes:
        x = np.ones(int(mib * (1 << 20)) // 4, np.float32)
        row = [best(lambda a=a: ar.allreduce(x, algorithm=a)) for a in ALGOS]
        row.append(best(lambda: ar.allreduce(x, name="b32")))
        row.append(best(lambda: ar.allreduce(x, name="b16", compression=ar.Compression.fp16)))
        if ar.rank() == 0:
            print(f"{mib:6g} " + " ".join(f"{t * 1e3:13.1f}" for t in row[:len(ALGOS)])
                  + f" {row[-2] * 1e3:10.1f} {row[-1] * 1e3:10.1f}", flush=True)
    ar.shutdown()


if __name__ == "__main__":
    main()
