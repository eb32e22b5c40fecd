"""Elastic training demo: kill a rank mid-run and watch the others go on.

::

    allreduce-run --elastic -np 4 python examples/elastic_train.py --kill-rank 2 --kill-step 12
    allreduce-run --elastic -np 4 --max-np 4 python examples/elastic_train.py --kill-rank 2   # grows back
    allreduce-run --elastic -np 3 --min-np 3 python examples/elastic_train.py --kill-rank 1   # stops
    ALLREDUCE_ELASTIC_HANG_TIMEOUT=5 allreduce-run --elastic -np 4 python examples/elastic_train.py --hang-rank 1
    ALLREDUCE_ELASTIC_HANG_TIMEOUT=5 allreduce-run --elastic -np 4 python examples/elastic_train.py --hang-rank 1 --pause 2

Linear regression by SGD with momentum, data sharded over the ranks: each
step allreduces the gradient (named: through the engine), a commit every
``--commit-every`` steps. Rank ``--kill-rank`` (its rank in the starting
world) SIGKILLs itself at ``--kill-step``; the survivors restore the last
commit, shrink, re-shard the data in a reset callback, and finish. Rank
``--hang-rank`` stops itself (SIGSTOP) at that step instead: alive but silent.
The others evict it after ``ALLREDUCE_ELASTIC_HANG_TIMEOUT`` seconds without a
heartbeat (allreduce/elastic/heartbeat.py), and go on as after a death. With
``--pause S`` a helper sends it SIGCONT S seconds later: under the bound it is
slow, not hung, and stays. Under
``--max-np`` the next commit spawns a replacement (this script again, named 4)
that gets the state by sync; the data is re-sharded over the grown world.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess

import numpy as np

import allreduce as ar
from allreduce import elastic
from allreduce.elastic import world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--kill-rank", type=int, default=-1, help="rank (in the starting world) that dies")
    parser.add_argument("--kill-step", type=int, default=12, help="the step of --kill-rank or --hang-rank")
    parser.add_argument("--hang-rank", type=int, default=-1, help="rank (in the starting world) that stops (SIGSTOP)")
    parser.add_argument("--pause", type=float, default=0.0, help="SIGCONT the stopped rank after this many s (0: never)")
    args = parser.parse_args()

    ar.init()
    name = world.name()           # rank in the starting world (a replacement: 4, 5, ...), for life
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 8))
    y = x @ np.arange(1.0, 9.0)
    shard = {}

    def reshard():                                       # a reset callback: the new size's slice
        shard["x"], shard["y"] = x[ar.rank()::ar.size()], y[ar.rank()::ar.size()]
    reshard()
    state = elastic.ObjectState(step=0, w=np.zeros(8), v=np.zeros(8))
    state.register_reset_callbacks([reshard])
    paused: list[int] = []

    @elastic.run
    def train(state):
        while state.step < args.steps:
            if name == args.kill_rank and state.step == args.kill_step:
                print(f"rank {name}: SIGKILL at step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if name == args.hang_rank and state.step == args.kill_step and not paused:
                paused.append(state.step)
                print(f"rank {name}: SIGSTOP at step {state.step}" + (f", SIGCONT in {args.pause:g} s"
                      if args.pause else ""), flush=True)
                if args.pause:
                    subprocess.Popen(["sh", "-c", f"sleep {args.pause}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
                print(f"rank {name}: going on after the pause", flush=True)
            xs, ys = shard["x"], shard["y"]
            local = xs.T @ (xs @ state.w - ys) / len(x)                 # this shard's part of the gradient
            grad = ar.allreduce(local, op=ar.Sum, name="grad")
            state.v = 0.5 * state.v + grad
            state.w = state.w - 0.3 * state.v
            state.step += 1
            if ar.rank() == 0 and state.step % 5 == 0:
                loss = float(np.mean((x @ state.w - y) ** 2))
                print(f"step {state.step:3d}  size {ar.size()}  loss {loss:.6f}", flush=True)
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    if ar.rank() == 0:
        print(f"done: w = {np.round(state.w, 4).tolist()} on {ar.size()} ranks", flush=True)
    ar.shutdown()


if __name__ == "__main__":
    main()
