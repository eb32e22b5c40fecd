"""The default call's small-message latency against raw MPI, and what the metadata check costs.

::

    mpirun --bind-to core -np 2 python benchmarks/latency_bench.py -b 8 -e 4K

OSU latency style (osu_allreduce): one block per size, microseconds, the slowest rank's best
mean over ``--repeats`` blocks of ``-n`` calls, the rows timed round-robin in one run:

* ``mpi4py``: raw ``comm.Allreduce(x, out)`` into a new array (what a user of mpi4py writes);
* ``default``: ``ar.allreduce(x, ar.Sum)`` with the defaults: metadata check on, ``auto``, timed
  once auto's run-time tuner has kept its pick for the size (``--settle``), as a training loop
  runs it; at -np 2 on one node that is :meth:`Communicator._pair_call`, one swap through the
  mailbox with the check's head in it;
* ``check-off``: the same with ``check=False``;
* ``check``: default minus check-off (what the check adds to the call), and ``head swap``:
  one head-only swap (``check_agreement``), what the check costs where no message of ours
  carries it (native ``MPI_Allreduce``, ring, tree, ...).

``--json`` keeps the rows (microseconds per size) for ``python benchmarks/report.py --only
defaultcall``, which renders this table and its goals (issue 28: default within 3x of mpi4py from
8 B to 4 KiB, 2x the stretch; the check under 1 us). The load average is printed at the start and
at the end: the VM is shared, and a row's absolute time moves with it, a same-run ratio far less.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-b", "--minbytes", type=common.parse_size, default=8)
    parser.add_argument("-e", "--maxbytes", type=common.parse_size, default=4096)
    parser.add_argument("-n", "--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--settle", type=int, default=400_000,
                        help="at most this many calls per size before timing, until auto keeps its pick")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    from mpi4py import MPI
    import allreduce as ar
    comm = ar.init(engine=False)
    world = MPI.COMM_WORLD
    on = comm.config
    off = dataclasses.replace(on, check=False)

    def block(fn, x) -> float:
        world.Barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn(x)
        return (time.perf_counter() - start) / args.iters

    rows = {"mpi4py": lambda x: world.Allreduce(x, np.empty_like(x), op=MPI.SUM),
            "default": lambda x: comm.allreduce(x, ar.Sum),
            "check-off": None,
            "head swap": lambda x: comm.check_agreement("allreduce", count=x.size, dtype=0, op=0, algorithm=0)}
    desc = common.machine_description()
    command = "allreduce-run --bind-to core -np %d python benchmarks/latency_bench.py %s" % (
        world.size, " ".join(sys.argv[1:] if argv is None else argv))
    records = []
    if world.rank == 0:
        print(f"# latency_bench: {world.size} ranks, float32, sum; load average {_load()} at start")
        print(f"# command: {command}")
        print("\n".join(common.machine_header(desc)))
        print(f"# time = slowest rank's best mean over {args.repeats} blocks of {args.iters} calls, rows round-robin")
        print("# timed once auto has kept its pick for the size (auto: what it runs; settle: the calls that took, "
              "the run-time tuner's trial and its ~0.5 s recheck), as in a training loop's steady state")
        print(f"# {'Size':>8} {'mpi4py':>9} {'default':>9} {'check-off':>10} {'check':>8} {'head swap':>10} "
              f"{'default/mpi4py':>15} {'auto':>8} {'settle':>8}")
    for nbytes in common.size_list(args.minbytes, args.maxbytes, 2.0):
        x = np.ones(max(1, nbytes // 4), np.float32)
        settled = 0                 # auto's tuner: the same call on every rank keeps the pick
        while settled < args.settle and x.nbytes not in comm.auto_picks:
            comm.allreduce(x, ar.Sum)
            settled += 1
        best = {name: float("inf") for name in rows}
        for _ in range(args.repeats):
            for name, fn in rows.items():
                comm.config = off if name == "check-off" else on
                best[name] = min(best[name], block(fn or rows["default"], x))
        comm.config = on
        us = {k: world.allreduce(v, op=MPI.MAX) * 1e6 for k, v in best.items()}
        records.append({"size_bytes": nbytes, "ranks": world.size, "mpi4py_us": us["mpi4py"],
                        "default_us": us["default"], "check_off_us": us["check-off"],
                        "check_us": us["default"] - us["check-off"], "head_swap_us": us["head swap"],
                        "default_over_mpi4py": us["default"] / us["mpi4py"],
                        "auto": comm.auto_picks.get(x.nbytes, "tuning"), "settle_calls": settled})
        if world.rank == 0:
            print(f"  {nbytes:>8} {us['mpi4py']:>9.2f} {us['default']:>9.2f} {us['check-off']:>10.2f} "
                  f"{us['default'] - us['check-off']:>8.2f} {us['head swap']:>10.2f} "
                  f"{us['default'] / us['mpi4py']:>14.2f}x {records[-1]['auto']:>8} {settled:>8}", flush=True)
    if world.rank == 0:
        print(f"# load average {_load()} at the end (2 cores; the machine is shared: absolute times move "
              "with the load, the same-run ratios far less)", flush=True)
        if args.json:
            common.write_json(args.json, {"command": command, "machine": desc, "ranks": world.size,
                                          "dtype": "float32", "op": "sum"}, records)
    ar.shutdown()


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()
