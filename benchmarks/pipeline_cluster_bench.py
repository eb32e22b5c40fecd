"""When pipeline parallelism pays: pipeline 2 against data 2 (and tensor 2) across two namespace hosts.

::

    python benchmarks/pipeline_cluster_bench.py --link 1gbit      # brings up cluster 'pp', always takes it down
    python benchmarks/pipeline_cluster_bench.py --link 100mbit    # a slow link: the bytes decide the order

Two models of examples/gpt.py, each trained across the two hosts of ``allreduce-cluster up --nodes 2
--prefix pp`` (one rank a host, one core each), by three splits of the same global batch::

    host 0 ──────── link (tbf, both ways) ──────── host 1
    data 2:      whole model, half the batch   allreduce of the W weight bytes     ~ 2(N-1)/N W a rank
    pipeline 2:  blocks 0..L/2-1 | L/2..L-1    activations B s h forward, grads back  2 B s h x 4 B in all
    tensor 2:    half of every layer           (4L+2) allreduces of B s h floats, in and out of every layer

``deep``: 8 blocks of hidden 512 on a short sequence (weights >> activations at the cut), where
pipeline should win; ``wide``: 2 blocks of hidden 32 on a long sequence and a large batch
(activations at the cut >> weights), where data parallelism should win.

Measured per step (after ``--warmup`` steps, the mean of ``--steps``): the bytes the two hosts'
``eth0`` sent (``/proc/net/dev`` read inside each host: the wire, TCP and MPI headers included;
load-independent) against the payload the byte counts above predict, and the step time on host 0.
Step times on a loaded machine measure the load too: compare the modes of one run with each other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "pp"
MODELS = {   # name: (layers, hidden, heads, seq, global batch)
    "deep": (8, 512, 8, 8, 8),
    "wide": (2, 32, 4, 256, 64),
}
MODES = ("data", "pipeline", "tensor")


def _eth0_tx() -> int:
    """Bytes this host's eth0 has sent (this process's network namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    raise RuntimeError("no eth0 in /proc/net/dev: run the worker inside the cluster (allreduce-run --cluster=pp)")


def _worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    import keras

    import tfops
    from tfops import parallel
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt
    from gpt_pipeline import pipeline_of
    tfops.init()
    ids, vocab = gpt.text_and_vocab()

    def barrier():
        tfops.allreduce(tf.constant(0.0), name="pipeline_cluster_bench.barrier")

    for name in args.models.split(","):
        layers, hidden, heads, seq, batch = MODELS[name]
        cfg = gpt.Config(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
        for mode in args.modes.split(","):
            mesh = parallel.Mesh(pipeline=2) if mode == "pipeline" else \
                parallel.Mesh(tensor=2) if mode == "tensor" else parallel.Mesh()
            model = gpt.build(cfg, mesh, seed=1)
            opt = keras.optimizers.Adam(1e-4)
            if mode == "pipeline":
                pipe = pipeline_of(model, mesh, micro_batches=args.micro_batches, schedule="1f1b")
                step = lambda x, y: pipe.train_step(x, y, opt)                     # noqa: E731
            else:
                step = gpt.train_step_fn(model, opt, mesh, mesh.data_set if mesh.data > 1 else None)
            rows = batch // mesh.data
            mine = slice(mesh.data_rank * rows, (mesh.data_rank + 1) * rows)
            times = []
            for i in range(args.warmup + args.steps):
                x, y = gpt.batch(ids, i, batch, seq)
                if i == args.warmup:
                    barrier()
                    tx0, start = _eth0_tx(), time.perf_counter()
                t = time.perf_counter()
                float(step(x[mine], y[mine]))
                times.append(time.perf_counter() - t)
            barrier()
            seconds, tx = (time.perf_counter() - start) / args.steps, (_eth0_tx() - tx0) / args.steps
            params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)      # this rank's share
            full = params * (mesh.tensor if mode == "tensor" else 1)
            spent = {"F": 0.0, "B": 0.0, "recv": 0.0}          # the last step's actions (Pipeline.events)
            for kind, _, _, t0, t1 in (pipe.events if mode == "pipeline" else []):
                spent[kind] += t1 - t0
            print(json.dumps({"model": name, "mode": mode, "rank": tfops.rank(), "step_s": seconds,
                              "tx_bytes": tx, "params": full, "act_bytes": batch * seq * hidden * 4,
                              "layers": layers, "last_step_s": times[-1], "spent": spent}), flush=True)
            del model, step, opt


def predicted(row: dict) -> float:
    """The payload bytes per step, both hosts together, from lesson 17's counts (N = 2 ranks)."""
    if row["mode"] == "data":
        return 2 * row["params"] * 4                    # ring at N = 2: each rank sends W
    if row["mode"] == "pipeline":
        return 2 * row["act_bytes"]                     # activations forward, their gradients back
    return 2 * (4 * row["layers"] + 2) * row["act_bytes"]   # an allreduce at N = 2: each rank sends its size


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--link", default="1gbit", help="the hosts' link rate, as tc writes it")
    ap.add_argument("--models", default="deep,wide")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    bin_ = os.path.dirname(sys.executable)
    print("$ python benchmarks/pipeline_cluster_bench.py " + " ".join(sys.argv[1:]))
    print("load:", _sh(["uptime"]).stdout.strip())
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
               OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    try:
        up = _sh([os.path.join(bin_, "allreduce-cluster"), "--prefix", PREFIX, "up", "--nodes", "2",
                  "--link", args.link], env=env)
        print(up.stdout.strip())
        if up.returncode:
            sys.exit(f"allreduce-cluster up failed: {up.stderr.strip()}")
        cmd = [os.path.join(bin_, "allreduce-run"), f"--cluster={PREFIX}", "-np", "2",   # forwards OMP_, TF_
               sys.executable, os.path.abspath(__file__), "--worker", "--models", args.models, "--modes", args.modes,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batches", str(args.micro_batches)]
        out = _sh(cmd, env=env, cwd=ROOT, timeout=1800)
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not rows:
            sys.exit(f"pipeline_cluster_bench: {' '.join(cmd)} failed ({out.returncode}):\n"
                     f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    finally:
        down = _sh([os.path.join(bin_, "allreduce-cluster"), "--prefix", PREFIX, "down"], env=env)
        print("down:", down.stdout.strip() or down.stderr.strip())
    print(f"\n2 hosts x 1 rank, link {args.link}; mean of {args.steps} steps after {args.warmup}; "
          f"pipeline: 1f1b, m = {args.micro_batches}\n")
    print("| model | layers x hidden, seq, batch | weights MiB | activation at a cut MiB | split | "
          "bytes/step predicted MiB | measured on the wire MiB | step s (host 0) | vs data |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        layers, hidden, _, seq, batch = MODELS[name]
        by_mode = {r["mode"]: r for r in rows if r["model"] == name and r["rank"] == 0}
        for mode in args.modes.split(","):
            r = by_mode[mode]
            wire = sum(q["tx_bytes"] for q in rows if q["model"] == name and q["mode"] == mode)
            ratio = r["step_s"] / by_mode["data"]["step_s"] if "data" in by_mode else float("nan")
            print(f"| {name} | {layers} x {hidden}, {seq}, {batch} | {r['params'] * 4 / 2**20:.1f} | "
                  f"{r['act_bytes'] / 2**20:.2f} | {mode} 2 | {predicted(r) / 2**20:.2f} | {wire / 2**20:.2f} | "
                  f"{r['step_s']:.3f} | {ratio:.2f}x |")
    for r in sorted((r for r in rows if r["mode"] == "pipeline"), key=lambda r: (r["model"], r["rank"])):
        f, b, w = r["spent"]["F"], r["spent"]["B"], r["spent"]["recv"]
        print(f"{r['model']} pipeline rank {r['rank']}, its last step of {r['last_step_s']:.3f} s: forwards {f:.3f} s, "
              f"backwards {b:.3f} s, waiting for a message {w:.3f} s")
    print("load:", _sh(["uptime"]).stdout.strip())


if __name__ == "__main__":
    main()
