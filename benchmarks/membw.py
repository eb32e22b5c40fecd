"""The physical bound: this machine's memory bandwidth, and how fast a reduction kernel runs.

On one machine every allreduce byte lives in the same DRAM. With p ranks
each holding S bytes, at least the p inputs must be read and the p outputs
written: 2 p S bytes through memory. So

    t >= 2 p S / B_mem      and      algbw = S / t <= B_mem / (2 p)

where B_mem counts bytes read plus bytes written. It bounds messages that
live in DRAM; one that fits in the caches (tens of KiB to a few MiB) can
beat it, which is why the bound matters at the large sizes. B_mem is measured with
the largest copy numpy does at memory speed (``np.copyto``, 256 MiB by
default, best of several); a copy of n bytes moves 2n bytes.

``cross_core`` measures what algorithm ``shm`` is made of: bytes moving
from one core's cache to another's through a shared segment. Rank 1 rewrites
a 2 MiB region that rank 0 read the round before (each written line must
first be taken back from rank 0's cache), then rank 0 reads it (each line
comes from rank 1's cache). The allreduce benchmark prints both figures in
its header. On the 2-core development VM they swing several-fold between
launches, and so does shm; but the probe is a clue, not a verdict: shm has
also run slowly at some sizes of a launch whose probe was high (docs/10).

``reduce_gamma`` measures the cost-model constant gamma (seconds per byte
reduced) with the library's own kernel, for ``fit_costmodel.py``: beta and
gamma always appear together as ``b*n*beta + g*n*gamma`` with b/g fixed per
algorithm, so no timing of an allreduce alone can separate them.

Run alone: ``python benchmarks/membw.py [--mib 256]``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

__all__ = ["copy_bandwidth", "all_ranks_bandwidth", "cross_core", "reduce_gamma", "allreduce_bound"]


def copy_bandwidth(nbytes: int = 256 << 20, *, repeats: int = 5) -> float:
    """Bytes per second moved (read + written) by the best of ``repeats`` copies of ``nbytes``.

    Args:
        nbytes: size of the copied buffer; use well beyond the last-level cache.
        repeats: how many copies to time; the fastest counts.

    Returns:
        B_mem in bytes/s.
    """
    src = np.ones(max(nbytes // 8, 1), dtype=np.float64)
    dst = np.empty_like(src)
    dst.fill(0.0)                     # touch every page before timing (zeros_like maps them lazily)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def all_ranks_bandwidth(mpi, nbytes: int, repeats: int = 4) -> float:
    """B_mem with every rank of the mpi4py communicator ``mpi`` copying ``nbytes`` at once: all
    bytes moved / the slowest rank's time, best of ``repeats`` (what the allreduce bound uses)."""
    from mpi4py import MPI
    src = np.ones(max(nbytes // 8, 1))
    dst = np.empty_like(src)
    dst.fill(0.0)
    best = float("inf")
    for _ in range(repeats):
        mpi.Barrier()
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, mpi.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return mpi.Get_size() * 2 * src.nbytes / best


def cross_core(transport, nbytes: int = 2 << 20, *, rounds: int = 50) -> tuple[float, float] | None:
    """Cache-to-cache bandwidth between ranks 0 and 1 of ``transport`` through a shared segment.

    Collective: every rank of ``transport`` calls it; ranks other than 0 and 1 only wait.

    Args:
        transport: a transport whose ranks share memory (MPI on one node, or threads).
        nbytes: the region rewritten and read each round.
        rounds: how many rewrite-then-read rounds to time.

    Returns:
        ``(read, rewrite)`` in bytes/s, the same on every rank: rank 0 reading lines rank 1
        just wrote, and rank 1 rewriting lines rank 0 just read. None with one rank, or
        when the ranks share no memory (several nodes).
    """
    from allreduce.algorithms import rd
    from allreduce.buffers import Workspace
    from allreduce.ops import Sum
    from allreduce.transport import shared
    if transport.size < 2:
        return None
    try:
        seg = shared.attach(transport, nbytes)
    except ValueError:                                  # several nodes: nothing to share
        return None
    me = transport.rank
    count = nbytes // 8
    region = seg.data(1, np.float64, count)
    mine = np.ones(count) if me in (0, 1) else None
    read = write = 0.0
    transport.barrier()
    for k in range(rounds + 1):                         # round 0, untimed, maps the pages
        if k == 1:
            read = write = 0.0
        if me == 1:
            start = time.perf_counter()
            np.copyto(region, mine)                     # lines rank 0 read last round
            write += time.perf_counter() - start
            seg.wait(0, seg.post())
        elif me == 0:
            seg.wait(1, seg.seq + 1)                    # the two flags count the rounds in step
            start = time.perf_counter()
            np.copyto(mine, region)                     # lines rank 1 just wrote
            read += time.perf_counter() - start
            seg.post()                                  # rank 1 may rewrite them
    times = np.array([read if me == 0 else 0.0, write if me == 1 else 0.0])
    rd.allreduce(transport, times, Sum, workspace=Workspace())   # both figures on every rank
    moved = rounds * count * 8
    return moved / times[0], moved / times[1]


def reduce_gamma(nbytes: int = 32 << 20, *, dtype=np.float32, repeats: int = 5) -> float:
    """Seconds per byte of ``kernels.reduce_into(dst, src, Sum)`` (best of ``repeats``).

    Args:
        nbytes: bytes of each operand.
        dtype: element type reduced.
        repeats: how many reductions to time; the fastest counts.

    Returns:
        gamma in s/byte, per byte of one operand (what the cost model's n counts).
    """
    from allreduce import kernels
    from allreduce.ops import Op
    count = max(nbytes // np.dtype(dtype).itemsize, 1)
    dst, src = np.ones(count, dtype), np.ones(count, dtype)
    kernels.reduce_into(dst[:8], src[:8], Op.SUM)        # compile outside the timing
    best = float("inf")
    for _ in range(repeats):
        np.copyto(dst, src)
        start = time.perf_counter()
        kernels.reduce_into(dst, src, Op.SUM)
        best = min(best, time.perf_counter() - start)
    return best / dst.nbytes


def allreduce_bound(b_mem: float, p: int) -> float:
    """Upper bound on allreduce algbw (bytes/s) for p ranks sharing memory of bandwidth ``b_mem``."""
    return b_mem / (2 * p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="copy size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    b_mem = copy_bandwidth(args.mib << 20, repeats=args.repeats)
    gamma = reduce_gamma()
    print(f"B_mem = {b_mem / 1e9:.2f} GB/s (np.copyto of {args.mib} MiB, read + write, best of {args.repeats})")
    print(f"gamma = {gamma * 1e9:.4f} ns/byte (float32 sum kernel, {1 / gamma / 1e9:.2f} GB/s of input)")
    for p in (2, 4, 8):
        print(f"p = {p}: allreduce algbw <= B_mem / (2p) = {allreduce_bound(b_mem, p) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
