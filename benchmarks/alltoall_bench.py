"""alltoall latency in the format of OSU's ``osu_alltoall``: ours (pairwise exchange) and MPI_Alltoall.

::

    mpirun -np 4 python benchmarks/alltoall_bench.py -b 1 -e 1M -f 4
    allreduce-run -np 2 python benchmarks/alltoall_bench.py -e 64K -n 200

Size is OSU's: the bytes each rank sends to *each* rank (so every rank sends
p times that). Timing as OSU: warm up, barrier, ``-n`` back-to-back calls,
each rank's mean per call; rows give the average, minimum and maximum over
ranks. "ours" is ``Communicator.alltoall`` (``algorithms/alltoall.py``,
including its one small allgather of the splits); "mpi" is mpi4py's
``Comm.Alltoall`` on numpy buffers. Rank 0 prints; stdout is only the blocks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import allreduce as ar  # noqa: E402
from benchmarks import common  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="OSU-style alltoall latency (run under mpirun)")
    parser.add_argument("-b", "--minbytes", type=common.parse_size, default=1, help="smallest size (default 1)")
    parser.add_argument("-e", "--maxbytes", type=common.parse_size, default=1 << 20, help="largest (default 1M)")
    parser.add_argument("-f", "--stepfactor", type=float, default=4.0, help="size factor (default 4)")
    parser.add_argument("-n", "--iters", type=int, default=100, help="timed calls per size (default 100)")
    parser.add_argument("-w", "--warmup", type=int, default=10, help="untimed calls first (default 10)")
    return parser.parse_args(argv)


def _time(run, iters: int, warmup: int, mpi_comm) -> float:
    for _ in range(warmup):
        run()
    mpi_comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    return (time.perf_counter() - start) / iters


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = ar.init(engine=False)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    blocks: dict[str, list[str]] = {"ours": [], "mpi": []}
    for size in common.size_list(args.minbytes, args.maxbytes, args.stepfactor):
        send = np.full(p * size, rank % 251, np.uint8)
        recv = np.empty_like(send)
        want = np.repeat(np.arange(p, dtype=np.uint8) % 251, size)
        ours_out = comm.alltoall(send)[0]
        world.Alltoall(send, recv)
        if not (np.array_equal(ours_out, want) and np.array_equal(recv, want)):
            raise SystemExit(f"rank {rank}: alltoall of {size} B per rank gave a wrong result")
        for name, run in (("ours", lambda: comm.alltoall(send)), ("mpi", lambda: world.Alltoall(send, recv))):
            seconds = _time(run, args.iters, args.warmup, world)
            times = world.gather(seconds, root=0)
            if rank == 0:
                us = np.array(times) * 1e6
                blocks[name].append(f"{size:<10d}{us.mean():>18.2f}{us.min():>18.2f}{us.max():>18.2f}"
                                    f"{args.iters:>12d}")
    if rank == 0:
        print("# " + " ".join(["allreduce-run -np", str(p), "python", *sys.argv]))
        for name, rows in blocks.items():
            print(f"\n# OSU MPI All-to-All Personalized Exchange Latency Test ({name}, {p} ranks)")
            print(f"# {'Size':<8}{'Avg Latency(us)':>18}{'Min Latency(us)':>18}{'Max Latency(us)':>18}"
                  f"{'Iterations':>12}")
            print("\n".join(rows))
    ar.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
