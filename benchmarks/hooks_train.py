"""Time to accuracy through each communication hook: a model whose gradient exchange is most of its step.

::

    allreduce-cluster up --nodes 2 --link 1gbit --slots 1
    allreduce-run --cluster -np 2 python benchmarks/hooks_train.py --json out.json
    allreduce-run -np 2 python benchmarks/hooks_train.py            # one node: where hooks do not pay

The model: a ReLU MLP 64 -> 2048 -> 2048 -> 10 (4.35 M float32 parameters: 17 MB of gradients
a step, against ~0.3 GFLOP of forward and backward at 16 samples per rank) on the 8x8 handwritten
digits (1437 training and 360 test images, examples/keras_digits.py's split), SGD with momentum
0.9, a global batch of 32, ``--steps`` steps. Every method trains from the same initial weights
on the same batches in the same order, in one ``tf.function`` step per batch with
``tfops.DistributedGradientTape(tape, comm_hook=...)`` (fp16: ``compression=``); methods as in
hooks_bench.py. Test accuracy every ``--eval-every`` steps; the clock counts the training steps
only: it stops while the model is evaluated, and skips step 1 (where TF traces the step).

Also in the same launch: ``compute``, the same step with no exchange at all (a plain tape). The
exchange's share of an fp32 step is ``1 - compute / fp32 step``.

Time to accuracy: the target is fp32's final test accuracy minus 1 point; a method's time is its
clock at the first evaluation at or above the target (``-`` if it never gets there).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras  # noqa: E402

import tfops  # noqa: E402
from keras_digits import load_data  # noqa: E402
from benchmarks.common import command_line  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reduction(method: str, start_iter: int) -> dict:
    """``DistributedGradientTape``'s keyword arguments for ``method``."""
    if method == "fp32":
        return {}
    if method == "fp16":
        return {"compression": tfops.Compression.fp16}
    if method.startswith("powersgd"):
        return {"comm_hook": tfops.PowerSGD(rank=int(method[len("powersgd"):]), start_iter=start_iter)}
    if method == "onebit":
        return {"comm_hook": tfops.OneBit()}
    raise SystemExit(f"hooks_train: unknown method {method!r}")


def build(width: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)])


def batches(n: int, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """Global batch indices, epoch after epoch, reshuffled with one seed (the same on every rank)."""
    rng, out = np.random.default_rng(seed), []
    while len(out) < steps:
        order = rng.permutation(n)
        out += [order[i:i + batch] for i in range(0, n - batch + 1, batch)]
    return out[:steps]


def train(method: str, data, args, exchange: bool = True) -> dict:
    """Train one method; return its evaluations ``[(step, seconds, accuracy)]`` and step times."""
    x, y, x_test, y_test = data
    size, rank = tfops.size(), tfops.rank()
    model = build(args.width, args.seed)
    opt = keras.optimizers.SGD(args.lr, momentum=0.9)
    kw = reduction(method, args.start_iter) if exchange else None

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        if kw is not None:
            tape = tfops.DistributedGradientTape(tape, **kw)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    evals, clock, times = [], 0.0, []
    for i, idx in enumerate(batches(len(y), args.batch, args.steps, args.seed), start=1):
        mine = idx[rank::size]
        start = time.perf_counter()
        step(tf.constant(x[mine]), tf.constant(y[mine])).numpy()
        times.append(time.perf_counter() - start)
        clock += times[-1] if i > 1 else 0.0          # step 1 traces the tf.function: not counted
        if kw is not None and (i % args.eval_every == 0 or i == args.steps):
            accuracy = float(np.mean(np.argmax(model(x_test, training=False).numpy(), -1) == y_test))
            evals.append((i, clock, accuracy))
    return {"method": method if exchange else "compute", "evals": evals,
            "step_ms": 1e3 * float(np.median(times[2:] if len(times) > 4 else times))}


def summary(runs: list[dict], args) -> list[str]:
    """The table: each method's final accuracy, median step, time to fp32's final - 1 point."""
    base = next(r for r in runs if r["method"] == "fp32")
    compute = next(r for r in runs if r["method"] == "compute")
    target = base["evals"][-1][2] - 0.01
    fp16 = next((r for r in runs if r["method"] == "fp16"), None)
    out = [f"# {command_line()}",
           f"# MLP 64-{args.width}-{args.width}-10 on digits, {tfops.size()} ranks, global batch {args.batch}, "
           f"{args.steps} steps, SGD lr {args.lr} momentum 0.9, eval every {args.eval_every} steps; "
           f"clock: training steps 2.. only",
           f"# compute alone (no exchange): {compute['step_ms']:.2f} ms a step; exchange share of an fp32 step: "
           f"{1 - compute['step_ms'] / base['step_ms']:.0%}",
           f"# target: fp32's final test accuracy {base['evals'][-1][2]:.4f} - 1 point = {target:.4f}",
           f"{'method':<10} {'step(ms)':>9} {'final acc':>10} {'to target(s)':>13} {'at step':>8} {'vs fp16':>8}"]
    for r in runs:
        if r["method"] == "compute":
            continue
        hit = next(((s, t) for s, t, a in r["evals"] if a >= target), None)
        r["to_target_s"] = hit[1] if hit else None
        f16 = fp16 and fp16.get("to_target_s")
        ratio = f"{hit[1] / f16:>7.2f}x" if hit and f16 else f"{'-':>8}"
        out.append(f"{r['method']:<10} {r['step_ms']:>9.2f} {r['evals'][-1][2]:>10.4f} "
                   f"{(f'{hit[1]:.2f}' if hit else '-'):>13} {(hit[0] if hit else '-'):>8} {ratio}")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="fp32,fp16,powersgd4")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--start-iter", type=int, default=10, help="PowerSGD's uncompressed first steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    tfops.init()
    data = load_data(args.seed)
    methods = args.methods.split(",")
    if "fp32" not in methods:
        methods.insert(0, "fp32")              # it sets the target
    runs = [train(m, data, args) for m in methods]
    runs.append(train("fp32", data, args, exchange=False))
    if tfops.rank() == 0:
        print("\n".join(summary(runs, args)), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"ranks": tfops.size(), "args": vars(args), "runs": runs},
                                                  indent=1))
    tfops.shutdown()


if __name__ == "__main__":
    main()
