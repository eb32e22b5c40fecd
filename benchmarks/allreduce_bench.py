"""Collective micro-benchmark in the format of nccl-tests (and OSU with ``--osu``).

::

    mpirun -np 2 python benchmarks/allreduce_bench.py -b 16 -e 64M -f 4 -c    # 16 B, 64 B, ..., 64 MiB
    mpirun -np 2 python benchmarks/allreduce_bench.py -b 8 -e 4K -f 2 --algorithms rd,tree,mpi --osu
    allreduce-run -np 4 python benchmarks/allreduce_bench.py --collective allgather --json out.json

Rank 0 prints one row per size and algorithm: our algorithms (ring, tree,
rhd, rd and "mpi", our wrapper of MPI_Allreduce) and the peers in the same
run (mpi4py called directly, Gloo through torch.distributed, Horovod); a
peer that is not installed is skipped with a '#' line. Timing, as in
nccl-tests and OSU: warm up, barrier, time ``-n`` back-to-back calls, take
each rank's mean per call and report the slowest rank. The communicator runs
with ``check=False``; what the cross-rank metadata check would add is
measured once and printed as a note. ``%bound`` is algbw as a percentage of
the memory-bandwidth bound B_mem / (2p) (see membw.py). Progress goes to
stderr; stdout is only the table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from allreduce import autotune  # noqa: E402
from benchmarks import checks, common, membw  # noqa: E402
from benchmarks.peers import Context, Unavailable, make_runner  # noqa: E402

DEFAULT_ALGORITHMS = "ring,tree,rhd,rd,mpi,mpi4py,gloo,horovod"
DEFAULT_OTHER = "ours,mpi4py,gloo,horovod"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="nccl-tests style collective benchmark (run under mpirun)")
    parser.add_argument("-b", "--minbytes", type=common.parse_size, default=common.parse_size("8"))
    parser.add_argument("-e", "--maxbytes", type=common.parse_size, default=common.parse_size("64M"))
    parser.add_argument("-f", "--stepfactor", type=float, default=2.0)
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed iterations (with --budget: fewer for slow rows, up to "
                             f"{FILL}x more for fast ones)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5)
    parser.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0,
                        help="validate results against exact integer-valued inputs; fills #wrong")
    parser.add_argument("-d", "--datatype", default="float32")
    parser.add_argument("-o", "--op", default="sum", choices=common.OP_NAMES)
    parser.add_argument("--collective", default="allreduce", choices=common.COLLECTIVES)
    parser.add_argument("--algorithms", default=None,
                        help=f"comma list (default {DEFAULT_ALGORITHMS}; other collectives {DEFAULT_OTHER})")
    parser.add_argument("--osu", action="store_true", help="print OSU latency blocks instead of the table")
    parser.add_argument("--json", default=None, help="write one record per row to this file")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds per row: fewer than -n iterations for slow rows, more (up to "
                             "50x) for fast ones (0 = always -n)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time the -n block this many times, round-robin; each rank keeps its fastest")
    parser.add_argument("--warmup-seconds", type=float, default=0.5,
                        help="before the first size, run every algorithm round-robin on it for about "
                             "this long (nccl-tests' one warm-up at the start; 0: none)")
    parser.add_argument("--membw-mib", type=int, default=256, help="copy size for B_mem (MiB)")
    parser.add_argument("--cold", type=int, default=0, metavar="MIB",
                        help="rotate the timed calls over distinct input buffers spanning MIB MiB, so no "
                             "call finds its data in the cache (gradients of a large model); 0: one "
                             "buffer, as nccl-tests and OSU time it")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup_iters < 0 or args.repeats < 1 or args.warmup_seconds < 0:
        parser.error("-n and --repeats must be >= 1, -w and --warmup-seconds >= 0")
    args.sizes = common.size_list(args.minbytes, args.maxbytes, args.stepfactor)
    default = DEFAULT_ALGORITHMS if args.collective == "allreduce" else DEFAULT_OTHER
    args.algorithm_list = [a.strip() for a in (args.algorithms or default).split(",") if a.strip()]
    return args


_START = time.perf_counter()


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[bench {time.perf_counter() - _START:6.1f} s] {text}", file=sys.stderr, flush=True)


def _max():
    from mpi4py import MPI
    return MPI.MAX


def measure_check_cost(mpi, iters: int = 50) -> float:
    """Microseconds one cross-rank metadata check (``check=True``) adds to a collective call."""
    from allreduce import Communicator, Config
    from allreduce.transport.mpi import MPITransport
    checked = Communicator(MPITransport(mpi), config=Config(check=True))
    try:
        for _ in range(10):
            checked.check_agreement("allreduce", count=1, dtype=2, op=0, algorithm=1)
        mpi.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            checked.check_agreement("allreduce", count=1, dtype=2, op=0, algorithm=1)
        return mpi.allreduce((time.perf_counter() - start) / iters, op=_max()) * 1e6
    finally:
        checked.close()


# Warm-up calls at most while auto's tuner times its contenders: timings of ~100-300 calls (two, and
# up to autotune.MAX_RECHECKS more in a slow spell), and between them its provisional winner for
# a gap (at most autotune.MAX_GAP calls each).
MAX_SETTLE = (1 + autotune.MAX_RECHECKS) * 2000 + autotune.MAX_RECHECKS * autotune.MAX_GAP
FILL = 50   # --budget lets a row of microsecond calls run up to this many times -n (OSU: 10000 small, 1000 large)


def warm_up(run, xs: list[np.ndarray], args, mpi) -> int:
    """Run the -w warmup calls; return the iterations to time (the same on all ranks).

    Without --budget, -n. With it, as many as fit in the budget: fewer than -n for a slow row,
    up to ``FILL`` x -n for a fast one. A 3 us call timed 20 times measures the noise, not the
    call, and the goals compare such rows to 10%.

    The first call (which may load compiled kernels, or allocate) runs before the clock starts:
    counted, it once cut the first row of a sweep to a single noisy timed call. So do the calls
    ``auto`` spends timing its contenders (its run-time tuner, ``run.steady``), at most
    ``MAX_SETTLE``: the timed blocks measure what it settled on, as every later call of a
    training loop runs it.
    """
    run(xs[0])
    steady = getattr(run, "steady", None)
    for i in range(MAX_SETTLE if steady else 0):
        if steady(xs[0].nbytes):
            break
        run(xs[i % len(xs)])
    start = time.perf_counter()
    for i in range(args.warmup_iters):
        run(xs[i % len(xs)])
    if args.budget <= 0:
        return args.iters
    per = mpi.allreduce((time.perf_counter() - start) / max(args.warmup_iters, 1), op=_max())
    return max(1, min(FILL * args.iters, int(args.budget / args.repeats / max(per, 1e-9))))


def warm_up_sweep(runners: dict, xs: list[np.ndarray], seconds: float, mpi) -> int:
    """Run every runner round-robin on the first size for about ``seconds``; return the rounds run.

    The first row of a sweep otherwise runs right after the 256 MiB B_mem copy and the metadata
    check's timing, with the caches, the branch predictors and the core's clock set for them:
    by hand, rd and tree's 8 B row came out 1.5x slower than the same size timed later in the
    same run, in every run. nccl-tests likewise warms up once before its first size. The rounds
    are agreed over the ranks (the slowest rank's round time), since every call is collective.
    """
    if seconds <= 0 or not runners:
        return 0
    for run in runners.values():   # the first calls compile and allocate: not a round's time
        run(xs[0])
    start = time.perf_counter()
    for run in runners.values():
        run(xs[0])
    per = mpi.allreduce(time.perf_counter() - start, op=_max())
    rounds = max(0, int(seconds / max(per, 1e-9)) - 1)
    for i in range(rounds):
        for run in runners.values():
            run(xs[i % len(xs)])
    return rounds + 2


def time_block(run, xs: list[np.ndarray], iters: int, mpi) -> float:
    """Barrier, then this rank's mean seconds over ``iters`` back-to-back calls (nccl-tests' timing),
    round-robin over the inputs ``xs`` (one, unless --cold)."""
    mpi.Barrier()
    k = len(xs)
    start = time.perf_counter()
    for i in range(iters):
        run(xs[i % k])
    return (time.perf_counter() - start) / iters


def timing_inputs(in_count: int, dtype, args) -> list[np.ndarray]:
    """The timed calls' inputs: one buffer, or (--cold) enough distinct ones to span --cold MiB."""
    x = checks.timing_input(in_count, dtype, args.op)
    copies = -(-(args.cold << 20) // max(x.nbytes, 1)) if args.cold else 1
    return [x] + [x.copy() for _ in range(min(copies, 4096) - 1)]


def time_size(runners: dict, xs: list[np.ndarray], args, mpi) -> dict[str, tuple[list[float], int]]:
    """``{name: (every rank's seconds per call, iterations)}`` for one size.

    With ``--repeats R`` the blocks run round-robin over the algorithms, R
    times, and each rank keeps its fastest block: a burst of other work on a
    shared machine then hits every algorithm alike instead of deciding one
    row, and only ever adds time (Python's timeit takes the minimum for the
    same reason). R = 1 is exactly nccl-tests' measurement. ``x`` is shared:
    the timing input is unchanged by any algorithm's in-place reduction.
    """
    iters = {name: warm_up(run, xs, args, mpi) for name, run in runners.items()}
    best = {name: float("inf") for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            best[name] = min(best[name], time_block(run, xs, iters[name], mpi))
    return {name: (mpi.allgather(best[name]), iters[name]) for name in runners}


def make_runners(names: list[str], ctx: Context, notes: list[str]) -> dict:
    """``{name: runner}`` for every name that can run here; a note for each that cannot."""
    runners = {}
    for name in names:
        try:
            runners[name] = make_runner(name, ctx)
        except Unavailable as exc:
            notes.append(f"skipped {name}: {exc}")
    return runners


def check_row(run, args, ctx: Context, count: int, in_count: int, want: np.ndarray) -> int:
    """Wrong elements of one call on the exact inputs, max over ranks."""
    rank = ctx.mpi_comm.Get_rank()
    got = run(checks.make_input(rank, ctx.size, in_count, ctx.dtype, args.op))
    return ctx.mpi_comm.allreduce(checks.count_wrong(got, want, args.op), op=_max())


def run_sweep(args, comm, mpi, b_mem: float, notes: list[str]) -> list[common.Row]:
    """All rows: at every size, every available algorithm (sizes outer: one expected result per size)."""
    p, rank = mpi.Get_size(), mpi.Get_rank()
    dtype = common.dtype_from_name(args.datatype)
    ctx = Context(comm=comm, mpi_comm=mpi, collective=args.collective, dtype=dtype, op=args.op)
    runners = make_runners(args.algorithm_list, ctx, notes)
    rows = []
    if args.sizes:
        _, first_in = checks.counts(args.sizes[0], dtype, args.collective, p)
        _progress(rank, f"warming up for {args.warmup_seconds:g} s on the first size")
        warm_up_sweep(runners, timing_inputs(first_in, dtype, args), args.warmup_seconds, mpi)
    for size in args.sizes:
        count, in_count = checks.counts(size, dtype, args.collective, p)
        nbytes = count * dtype.itemsize
        _progress(rank, f"{args.collective} {common.human_size(nbytes)}: {', '.join(runners)}")
        want = checks.expected(rank, p, count, dtype, args.op, args.collective) if args.check else None
        wrong = {name: check_row(run, args, ctx, count, in_count, want) if args.check else None
                 for name, run in runners.items()}
        timed = time_size(runners, timing_inputs(in_count, dtype, args), args, mpi)
        for name, (times, iters) in timed.items():
            t = max(times)
            algbw, busbw = common.bandwidths(nbytes, t, args.collective, p)
            bound = algbw * 1e9 / membw.allreduce_bound(b_mem, p) if args.collective == "allreduce" else None
            rows.append(common.Row(args.collective, nbytes, count, dtype.name, args.op, name, p, t * 1e6,
                                   algbw, busbw, wrong=wrong[name], min_us=min(times) * 1e6,
                                   avg_us=sum(times) / p * 1e6, max_us=t * 1e6, iters=iters, bound_frac=bound))
    if "auto" in runners and args.collective == "allreduce":
        notes.append(auto_note(comm, sorted({r.size_bytes for r in rows})))
    return rows


def auto_note(comm, sizes: list[int]) -> str:
    """What ``auto`` ran at each size of the sweep, and where its tuner timed contenders to pick,
    their scores (us: the best block's mean, slowest rank; allreduce/autotune.py)."""
    decided = comm.tuner.decided if comm.tuner is not None else {}
    picks = []
    for n in sizes:
        if n in comm.auto_picks:
            scores = decided.get(n)
            tried = " (" + " ".join(f"{a} {t * 1e6:.0f}" for a, t in scores.items()) + ")" if scores else ""
            picks.append(f"{common.human_size(n)} {comm.auto_picks[n]}{tried}")
    return "auto ran (tuner's scores, us): " + ", ".join(picks)


def report(args, rows: list[common.Row], header: list[str], notes: list[str]) -> str:
    """The text rank 0 prints: header, notes, then the table or the OSU blocks."""
    lines = header + [common.note(n) for n in notes]
    if args.osu:
        for name in dict.fromkeys(r.algorithm for r in rows):
            lines += [""] + common.osu_header(args.collective, name)
            lines += [common.format_osu(r) for r in rows if r.algorithm == name]
        return "\n".join(lines)
    lines += common.table_header()
    order = {name: i for i, name in enumerate(args.algorithm_list)}
    lines += [common.format_row(r) for r in sorted(rows, key=lambda r: (r.size_bytes, order[r.algorithm]))]
    for name in dict.fromkeys(r.algorithm for r in rows):
        mine = [r.busbw_gbps for r in rows if r.algorithm == name]
        lines.append(common.note(f"Avg bus bandwidth ({name}): {sum(mine) / len(mine):.3f} GB/s"))
    if args.check:
        lines.append(common.note(f"Out of bounds values : {sum(r.wrong or 0 for r in rows)} "
                                 f"{'OK' if not any(r.wrong for r in rows) else 'FAILED'}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from allreduce.transport.mpi import MPI   # MPI starts with the library's Open MPI defaults
    import allreduce as ar
    mpi = MPI.COMM_WORLD
    rank, p = mpi.Get_rank(), mpi.Get_size()
    comm = ar.init(check=False)
    command = common.command_line()
    desc = common.machine_description()
    _progress(rank, "measuring memory bandwidth")
    b_mem = membw.all_ranks_bandwidth(mpi, args.membw_mib << 20)
    gamma = membw.reduce_gamma(min(32 << 20, args.membw_mib << 20)) if rank == 0 else 0.0
    cross = membw.cross_core(comm.transport)
    _progress(rank, "measuring the metadata check")
    check_us = measure_check_cost(mpi)
    bound = membw.allreduce_bound(b_mem, p)
    header = [f"# {args.collective} benchmark: {p} ranks, {args.datatype}, op {args.op}",
              f"# command: {command}"] + common.machine_header(desc) + [
        f"# B_mem = {b_mem / 1e9:.2f} GB/s (all ranks np.copyto {args.membw_mib} MiB at once, read+write, best of 4)",
        f"# bound: allreduce algbw <= B_mem/(2p) = {bound / 1e9:.3f} GB/s"
        f" (busbw {bound * common.bus_factor('allreduce', p) / 1e9:.3f} GB/s); %bound = algbw / bound;"
        " a DRAM bound: messages that stay in cache can pass it",
    ] + ([f"# cross-core, ranks 0 and 1, 2 MiB through shared memory: {cross[0] / 1e9:.1f} GB/s reading lines "
          f"the peer wrote, {cross[1] / 1e9:.1f} GB/s rewriting lines the peer read, before the sweep "
          "(benchmarks/membw.py)"] if cross else []) + [
        f"# metadata check (check=True) adds {check_us:.1f} us per collective call; rows below use check=False",
        (f"# every algorithm first runs round-robin on the first size for {args.warmup_seconds:g} s; "
         if args.warmup_seconds else "# ")
        + f"time = slowest rank's mean over -n {args.iters} calls after -w {args.warmup_iters} warmup"
        + (f" (with --budget {args.budget:g} s per row: fewer for slow rows, up to {FILL}x more for fast ones)"
           if args.budget else "")
        + (f"; best of --repeats {args.repeats} such blocks per rank, round-robin over the algorithms"
           if args.repeats > 1 else "")
        + (f"; cold: the calls rotate over distinct inputs spanning {args.cold} MiB per rank, so every "
           "call reads its data from memory" if args.cold else "")]
    notes: list[str] = []
    rows = run_sweep(args, comm, mpi, b_mem, notes)
    if rank == 0:
        print(report(args, rows, header, notes), flush=True)
        if args.json:
            payload = {"command": command, "machine": desc, "collective": args.collective, "ranks": p,
                       "cold_mib": args.cold,
                       "dtype": args.datatype, "op": args.op, "membw_gbps": b_mem / 1e9,
                       "bound_algbw_gbps": bound / 1e9 if args.collective == "allreduce" else None,
                       "gamma_s_per_byte": gamma, "check_cost_us": check_us, "notes": notes,
                       "cross_core_gbps": cross and {"read": cross[0] / 1e9, "rewrite": cross[1] / 1e9},
                       "auto_picks": {str(r.size_bytes): comm.auto_picks[r.size_bytes] for r in rows
                                      if r.algorithm == "auto" and r.size_bytes in comm.auto_picks}}
            common.write_json(args.json, payload, (r.record() for r in rows))
    bad = any(r.wrong for r in rows)
    ar.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
