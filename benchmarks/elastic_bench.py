"""What elastic training costs: recovery after a death, and the steady state under ``--elastic``.

::

    python benchmarks/elastic_bench.py                      # recovery at -np 3 and 4, then the steady state
    python benchmarks/elastic_bench.py --recovery-only --sizes 3,4 --rounds 3
    python benchmarks/elastic_bench.py --regrow --recovery-only     # also grow back (--max-np N)

Recovery. Each launch (``allreduce-run --elastic -np N``) trains a model of
``--params`` float32 parameters: a named allreduce of its gradient per step
(the engine: negotiation, fusion), a commit every 10 steps. The last rank
SIGKILLs itself at step 25 and writes the time. The survivors time the phases
of :mod:`allreduce.elastic.recovery`::

    detection   the kill -> the survivor's pending call raised PeerLostError
    shrink      restore the last commit, revoke, MPI_Comm_shrink
    rebuild     ar.shutdown(); ar.init() on the shrunk world (engine, windows, mailboxes)
    sync        broadcast of rank 0's state (the model's bytes)
    first step  the first step after the sync, to its end

and the new rank 0 reports them (the latest survivor's detection: every
survivor must have noticed before the shrink can finish). With ``--regrow``
the launches run under ``--max-np N``: the commit at step 30 spawns a
replacement (:mod:`allreduce.elastic.regrow`), timed as ``regrow`` (the
commit -> the first step completed at full size again, a Python start and the
sync included) and ``kill -> full`` (the SIGKILL -> that step).

Steady state. ``examples/synthetic_benchmark.py`` at -np 2 three ways: plain;
plain with ``--mca btl tcp,self`` (what ULFM's TCP costs MPI's own messages);
``--elastic`` with ``--commit-every 10``. Images per second, the same
command lines, one after the other on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KILL_STEP, STEPS, EVERY = 25, 40, 10


def worker(params: int) -> None:
    """One rank of a recovery launch (under allreduce-run --elastic)."""
    import numpy as np

    import allreduce as ar
    from allreduce import elastic
    from allreduce.elastic import recovery, world
    ar.init()
    victim = ar.size() - 1
    state = elastic.ObjectState(step=0, w=np.zeros(params, np.float32))
    times: dict[str, float] = {}

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step == KILL_STEP and ar.rank() == victim and not recovery.deaths:
                print(f"KILLED {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            grad = ar.allreduce(np.full(params, 1e-3, np.float32), name="grad")
            state.w -= grad
            state.step += 1
            if recovery.deaths and "first_step" not in times:
                times["first_step"] = time.time()
            if world.joins and "full_step" not in times:
                times["full_step"], times["spawned"] = time.time(), world.joins[-1][0]
            if state.step % EVERY == 0:
                state.commit()

    train(state)
    caught = ar.allgather_object(recovery.last_recovery.get("caught", 0.0))
    if ar.rank() == 0:
        print("RECOVERY " + json.dumps({**recovery.last_recovery, "caught": max(caught), **times}), flush=True)
    ar.shutdown()


def recovery_round(np_: int, params: int, *, regrow: bool = False) -> dict[str, float]:
    grow = ["--max-np", str(np_)] if regrow else []
    cmd = [sys.executable, "-m", "allreduce.run", "--elastic", "-np", str(np_), *grow, sys.executable, __file__,
           "--worker", "--params", str(params)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT).stdout
    killed = float(re.search(r"^KILLED ([\d.]+)$", out, re.M).group(1))
    t = json.loads(re.search(r"^RECOVERY (.*)$", out, re.M).group(1))
    return {"detection": t["caught"] - killed, "shrink": t["shrunk"] - t["caught"],
            "rebuild": t["rebuilt"] - t["shrunk"], "sync": t["synced"] - t["rebuilt"],
            "first step": t["first_step"] - t["synced"], "total": t["first_step"] - killed,
            **({"regrow": t["full_step"] - t["spawned"], "kill -> full": t["full_step"] - killed} if regrow else {})}


def steady_state(batches: int) -> list[tuple[str, float]]:
    bench = [sys.executable, "examples/synthetic_benchmark.py", "--num-iters", "5",
             "--num-batches-per-iter", str(batches)]
    runs = [("plain", ["-np", "2"], []), ("plain, --mca btl tcp,self", ["-np", "2", "--mca", "btl", "tcp,self"], []),
            ("--elastic, commit every 10", ["--elastic", "-np", "2"], ["--commit-every", "10"])]
    rows = []
    for label, launch, extra in runs:
        cmd = [sys.executable, "-m", "allreduce.run", *launch, *bench, *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT).stdout
        rows.append((label, float(re.search(r"total img/sec on \d+ rank\(s\): ([\d.]+)", out).group(1))))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, default=300_000, help="model size, float32 parameters")
    parser.add_argument("--sizes", default="3,4")
    parser.add_argument("--rounds", type=int, default=2, help="launches per size; the table shows medians")
    parser.add_argument("--recovery-only", action="store_true")
    parser.add_argument("--regrow", action="store_true", help="--max-np N: time growing back as well")
    parser.add_argument("--batches", type=int, default=20, help="steady state: batches per timed iteration")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.params)
    print(f"# command: python benchmarks/elastic_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# uptime: {os.popen('uptime').read().strip()}")
    print(f"# recovery after a SIGKILL at step {KILL_STEP} (commit every {EVERY}), {args.params} float32 "
          f"parameters, median of {args.rounds} launch(es), seconds")
    phases = ["detection", "shrink", "rebuild", "sync", "first step", "total"]
    phases += ["regrow", "kill -> full"] if args.regrow else []
    print(f"{'np':>4} " + " ".join(f"{p:>11}" for p in phases))
    for np_ in (int(n) for n in args.sizes.split(",")):
        rounds = [recovery_round(np_, args.params, regrow=args.regrow) for _ in range(args.rounds)]
        print(f"{np_:>4} " + " ".join(f"{statistics.median(r[p] for r in rounds):>11.3f}" for p in phases),
              flush=True)
    if args.recovery_only:
        return
    print(f"\n# steady state: examples/synthetic_benchmark.py -np 2, img/sec (total), {args.batches} batches "
          "per iteration, 5 iterations")
    rows = steady_state(args.batches)
    base = rows[0][1]
    print(f"{'run':<32} {'img/sec':>9} {'vs plain':>9}")
    for label, rate in rows:
        print(f"{label:<32} {rate:>9.1f} {rate / base:>8.2f}x")
    print(f"# uptime after: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
