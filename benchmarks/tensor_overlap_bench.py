"""Does the input-gradient allreduce overlap the weight-gradient matmul, and does it pay? (issue 42)

::

    python benchmarks/tensor_overlap_bench.py                    # hidden 512 and 1024, -np 2, tensor 2
    python benchmarks/tensor_overlap_bench.py --hidden 1024 --steps 10

Megatron-LM starts the allreduce of a column layer's input gradient (f's backward, ``dX = dY W^T``
summed over the tensor group) asynchronously and computes the weight gradient ``dW = X^T dY``
while it runs. In a ``tf.function`` the two are nodes of one backward graph with no edge between
them: the allreduce is a ``numpy_function`` reading ``dX``, and ``dW`` reads ``X`` and ``dY``.
TensorFlow's executor may therefore run them at once on two inter-op threads, with nothing written
for it. This benchmark looks at what it does, from TensorFlow's own profiler trace (every op a
span on the inter-op thread that ran it), and at what it buys.

For each inter-op thread count (1: no two ops at once; 2: what ``tensor_bench.py`` uses), one
``-np 2`` launch of the GPT of ``examples/gpt.py`` at tensor 2 (2 blocks, 4 heads, seq 64, batch
8, Adam, one intra-op thread a rank): the median step time of ``--steps`` steps after 3 warm-up
steps, then two steps under ``tf.profiler``; from their trace, the tensor allreduces of the
backward (``tfops_tensor_allreduce`` ops that start after the step's first ``gradient_tape/`` op:
f's backward in each block and the embedding's) and how much of their time a matmul (``MatMul``,
``BatchMatMul``, ``Einsum``) ran on another inter-op thread.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATMULS = ("MatMul", "BatchMatMul", "Einsum")
FORWARD = "gpt"                                   # the example's model scope (gpt_1/...)


def _ops(path: str) -> list[tuple[str, str, float, float, str]]:
    """(op name, op type, start us, end us, thread) of every op TensorFlow's inter-op threads ran."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    out = []
    for plane in space.planes:
        meta = plane.event_metadata
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for ev in line.events:
                full = meta[ev.metadata_id].name
                if ":" not in full:                      # the executor's own regions, not ops
                    continue
                name, kind = full.rsplit(":", 1)
                start = line.timestamp_ns * 1e-3 + ev.offset_ps * 1e-6
                out.append((name, kind, start, start + ev.duration_ps * 1e-6, line.name))
    return out


def overlap(ops: list) -> dict:
    """Backward tensor allreduces: their time, and the part of it a matmul ran on another thread."""
    reduces, backward = [], False                        # in time order: a step's backward starts with its
    for o in sorted(ops, key=lambda o: o[2]):            # first gradient_tape/ op, the next step with its model's op
        if o[0].startswith("gradient_tape/"):
            backward = True
        elif o[0].startswith(FORWARD):
            backward = False
        if backward and o[1] == "PyFunc" and "tensor_allreduce" in o[0]:
            reduces.append(o)
    mats = [o for o in ops if any(m in o[1] for m in MATMULS)]
    total = covered = 0.0
    for name, _, s, e, thread in reduces:
        spans = sorted((max(s, ms), min(e, me)) for _, _, ms, me, t in mats if t != thread and ms < e and me > s)
        at, got = s, 0.0
        for a, b in spans:                               # union of the matmuls' time inside [s, e]
            a = max(a, at)
            if b > a:
                got += b - a
                at = b
        total += e - s
        covered += got
    return {"reduces": len(reduces), "reduce_us": total, "overlapped_us": covered}


def worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter)
    import keras
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt
    import tfops
    from tfops import parallel
    tfops.init()
    mesh = parallel.Mesh(tensor=tfops.size())
    ids, vocab = gpt.text_and_vocab()
    cfg = gpt.Config(layers=2, hidden=args.hidden[0], heads=4, seq=64, vocab=vocab)
    model = gpt.build(cfg, mesh)
    step = gpt.train_step_fn(model, keras.optimizers.Adam(1e-3), mesh)
    times = []
    for i in range(3 + args.steps):
        x, y = gpt.batch(ids, i, 8, cfg.seq)
        start = time.perf_counter()
        float(step(x, y))
        if i >= 3:
            times.append(time.perf_counter() - start)
    logdir = tempfile.mkdtemp(prefix=f"tensor_overlap.{tfops.rank()}.")
    tf.profiler.experimental.start(logdir)
    for i in range(2):
        x, y = gpt.batch(ids, 100 + i, 8, cfg.seq)
        float(step(x, y))
    tf.profiler.experimental.stop()
    got = overlap(_ops(sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))[-1]))
    print("RESULT " + json.dumps({"rank": tfops.rank(), "hidden": args.hidden[0], "inter": args.inter,
                                  "step_ms": statistics.median(times) * 1e3, **got, "steps_traced": 2}), flush=True)
    tfops.shutdown()


def launch(hidden: int, inter: int, steps: int) -> list[dict]:
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2", sys.executable, __file__, "--worker",
           "--hidden", str(hidden), "--inter", str(inter), "--steps", str(steps)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    rows = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or len(rows) != 2:
        sys.exit(f"tensor_overlap_bench: {' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--inter", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print("$ python benchmarks/tensor_overlap_bench.py " + " ".join(sys.argv[1:]))
    print(f"load before: {os.getloadavg()[0]:.1f} (1-minute average, 2 cores)")
    print("\n| hidden | inter-op threads | step ms (rank 0) | backward tensor allreduces a step | their time a step, ms "
          "(rank 0 / 1) | of it with a matmul on another thread |")
    print("|---:|---:|---:|---:|---:|---:|")
    for hidden in args.hidden:
        for inter in (1, 2):
            rows = sorted(launch(hidden, inter, args.steps), key=lambda r: r["rank"])
            per = [r["reduce_us"] / 1e3 / r["steps_traced"] for r in rows]
            share = [r["overlapped_us"] / r["reduce_us"] if r["reduce_us"] else 0.0 for r in rows]
            print(f"| {hidden} | {inter} | {rows[0]['step_ms']:.1f} | {rows[0]['reduces'] // rows[0]['steps_traced']} | "
                  f"{per[0]:.1f} / {per[1]:.1f} | {100 * share[0]:.0f}% / {100 * share[1]:.0f}% |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
