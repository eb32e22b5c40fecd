"""Tensor parallelism's step time on one node: tensor 2 (one intra-op thread a rank) against one
process with two intra-op threads, on the same GPT and global batch, across hidden sizes.

::

    python benchmarks/tensor_bench.py                       # hidden 64, 256, 512; prints the table
    python benchmarks/tensor_bench.py --hidden 128 768 --steps 20
    python benchmarks/tensor_bench.py --part memory --budget-mib 1400   # a GPT too big for the budget plain

Both arms use the same cores (2), the same model (examples/gpt.py: 2 blocks, 4 heads, seq 64) and
the same global batch (8 rows), Adam, in a ``tf.function``. Each arm is its own launch
(``allreduce-run -np 2 ... --worker --tensor 2 --threads 1`` and ``python ... --worker --tensor 1
--threads 2``); a worker times ``--steps`` steps after 3 warm-up steps and prints one JSON line,
the median step time. The table gives the ratio tensor 2 / one process: below 1 tensor
parallelism wins. Small models lose (each block's 4 collectives cost the same ~100 us whatever the
size, while the matmuls shrink); larger ones approach break-even. The machine's load is printed
beside the table: on a loaded machine the ratio is noisy, compare rows of one run only.

``--part memory``: the same GPT at hidden 1024, 4 blocks (50.5 M parameters), seq 64, batch 4,
``init="per_rank"`` (no rank draws a full matrix), trained 4 Adam steps as one process (tensor 1)
and at tensor 4 (-np 4). Each process reports ``ru_maxrss`` (every page it ever held resident,
TensorFlow's runtime included) and whether it stayed under ``--budget-mib``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt
    import tfops
    from tfops import parallel
    tfops.init()
    mesh = parallel.Mesh(tensor=args.tensor)
    ids, vocab = gpt.text_and_vocab()
    memory = args.part == "memory"
    hidden = args.hidden[0]
    cfg = gpt.Config(layers=4 if memory else 2, hidden=hidden, heads=8 if memory else 4, seq=64, vocab=vocab,
                     init="per_rank" if memory else "sliced")
    model = gpt.build(cfg, mesh)
    step = gpt.train_step_fn(model, keras.optimizers.Adam(1e-3), mesh)
    times = []
    for i in range(3 + args.steps):
        x, y = gpt.batch(ids, i, 4 if memory else 8, cfg.seq)
        start = time.perf_counter()
        float(step(x, y))
        times.append(time.perf_counter() - start)
    params = sum(int(v.numpy().size) for v in model.trainable_variables)
    import resource
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    every = tfops.allgather_object(peak_mib)
    if tfops.rank() == 0:
        print(json.dumps({"tensor": args.tensor, "threads": args.threads, "hidden": hidden,
                          "params_per_rank": params, "step_s": statistics.median(times[3:]),
                          "peak_rss_mib": every}), flush=True)


def launch(tensor: int, threads: int, hidden: int, steps: int, part: str = "time") -> dict:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tensor", str(tensor), "--threads",
          str(threads), "--hidden", str(hidden), "--steps", str(steps), "--part", part]
    cmd = (["allreduce-run", "-np", str(tensor)] + me) if tensor > 1 else me
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not rows:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return rows[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--part", choices=("time", "memory"), default="time")
    ap.add_argument("--budget-mib", type=float, default=1400)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.part == "memory":
        print(f"$ python benchmarks/tensor_bench.py --part memory --budget-mib {args.budget_mib:g}")
        print(f"load before: {os.getloadavg()[0]:.1f} (1-minute average, {os.cpu_count()} cores)")
        for tensor in (1, 4):
            row = launch(tensor, 1, 1024, 1, "memory")
            peaks = row["peak_rss_mib"]
            verdict = "within" if max(peaks) <= args.budget_mib else "OVER"
            print(f"tensor {tensor}: {row['params_per_rank'] / 1e6:.1f} M parameters a rank, peak RSS per rank "
                  f"{', '.join(f'{p:.0f}' for p in peaks)} MiB: {verdict} the {args.budget_mib:g} MiB budget",
                  flush=True)
        print(f"load after: {os.getloadavg()[0]:.1f}")
        return None
    print(f"$ python benchmarks/tensor_bench.py --hidden {' '.join(map(str, args.hidden))} --steps {args.steps}")
    print(f"load before: {os.getloadavg()[0]:.1f} (1-minute average, {os.cpu_count()} cores)")
    print(f"{'hidden':>6} {'params (1 proc)':>15} {'1 proc x 2 thr (ms)':>20} {'tensor 2 x 1 thr (ms)':>22} "
          f"{'ratio':>6}")
    for hidden in args.hidden:
        one = launch(1, 2, hidden, args.steps)
        two = launch(2, 1, hidden, args.steps)
        print(f"{hidden:>6} {one['params_per_rank']:>15} {one['step_s'] * 1e3:>20.1f} {two['step_s'] * 1e3:>22.1f} "
              f"{two['step_s'] / one['step_s']:>6.2f}", flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
