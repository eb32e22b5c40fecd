"""Rank script: how the fusion threshold changes one training step's gradient allreduce.

::

    mpirun -np 2 python tests/mpi/engine_fusion_sweep.py [--steps 5] [--scale 1.0] [--backward-ms 0] [THRESHOLD ...]

Submits ResNet-50's 161 float32 gradients (25.6M values, from
benchmarks/resnet50_shapes.py; ``--scale`` shrinks every tensor) in reverse
order, as backpropagation produces them (``--backward-ms`` spreads a
simulated backward pass of that length between them, in proportion to each
tensor's size, so communication can overlap it), waits for all, and prints the
slowest rank's median and minimum step time per threshold (on a shared,
loaded machine the minimum is the less disturbed number). Results are checked against
the expected average, so the sweep doubles as a test (tests/test_engine_mpi.py
runs it tiny). This is the measurement behind the default
``fusion_threshold`` in config.py.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import allreduce as ar  # noqa: E402
from benchmarks.resnet50_shapes import SHAPES  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("thresholds", nargs="*", type=int,
                    default=[0, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--scale", type=float, default=1.0)
parser.add_argument("--backward-ms", type=float, default=0.0)
args = parser.parse_args()
world = MPI.COMM_WORLD
me, p = world.Get_rank(), world.Get_size()
shapes = [(max(1, int(shape[0] * args.scale)),) + tuple(shape[1:]) for _, shape in SHAPES]
grads = [np.full(s, me + 1, np.float32) for s in shapes][::-1]   # the last layer's gradient comes first
want = (p + 1) / 2
total = sum(g.nbytes for g in grads)
compute = [args.backward_ms / 1e3 * g.nbytes / total for g in grads]   # seconds before each gradient
if me == 0:
    print(f"# {len(grads)} tensors, {total / 2**20:.1f} MiB float32, {p} ranks, {args.steps} steps, "
          f"simulated backward pass {args.backward_ms:g} ms")
    print(f"# {'threshold(B)':>14} {'median(ms)':>10} {'min(ms)':>10} {'busbw(GB/s)':>12}  (busbw from min)")
for threshold in args.thresholds:
    ar.init(fusion_threshold=threshold)
    times = []
    for step in range(args.steps + 1):                       # the first step warms the cache up
        world.Barrier()
        t = time.perf_counter()
        handles = []
        for i, g in enumerate(grads):
            if compute[i]:
                time.sleep(compute[i])                       # "computing" this gradient
            handles.append(ar.allreduce_async(g, name=f"grad{i}"))
        results = [h.wait() for h in handles]
        times.append(time.perf_counter() - t)
        assert all(float(r.flat[0]) == want and float(r.flat[-1]) == want for r in results)
    ar.shutdown()
    slowest = np.max(world.allgather(times[1:]), axis=0)     # a step ends when its slowest rank does
    if me == 0:
        best = float(slowest.min())
        busbw = 2 * (p - 1) / p * total / best / 1e9
        print(f"  {threshold:>14} {np.median(slowest) * 1e3:>10.2f} {best * 1e3:>10.2f} {busbw:>12.2f}",
              flush=True)
