"""Horovod's side of the peer comparison: horovod.tensorflow 0.28.1 on TF 2.12, in its own venv.

::

    bash benchmarks/peers/build_horovod.sh            # once: .venv-horovod (about 10 min)
    .venv-horovod/bin/mpirun -np 2 .venv-horovod/bin/python benchmarks/peers/horovod_bench.py --json hvd.json
    .venv-horovod/bin/mpirun -np 2 .venv-horovod/bin/python benchmarks/peers/horovod_bench.py \\
        --measures training --threads 1 --json hvd_train.json

The micro measures (latency, grouped, busbw: benchmarks/peers/timing.py) time
``hvd.allreduce`` / ``hvd.grouped_allreduce`` on eager TF tensors with
``op=hvd.Average`` and a name, as ours_bench.py times tfops. ``training`` is the
model, batch and timing loop of examples/synthetic_benchmark.py written for Keras 2
(``tf.keras``) with ``hvd.DistributedGradientTape``: Horovod on TF 2.12 / Keras 2,
where ours runs on TF 2.21 / Keras 3. Horovod runs with its defaults (cycle time,
fusion threshold, MPI controller and MPI CPU operations).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from benchmarks.peers import timing  # noqa: E402

MEASURES = (*timing.MEASURES, "training")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Horovod (horovod.tensorflow) for the peer comparison")
    parser.add_argument("--measures", default=",".join(timing.MEASURES))
    parser.add_argument("--max-bytes", type=int, default=timing.SIZES[-1], help="largest busbw size")
    parser.add_argument("--quick", action="store_true", help="a few calls per row: checks the plumbing")
    parser.add_argument("--threads", type=int, default=1, help="TF intra- and inter-op threads per rank")
    parser.add_argument("--batch-size", type=int, default=32, help="training: per-rank batch")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.measure_list = [m for m in args.measures.split(",") if m]
    unknown = set(args.measure_list) - set(MEASURES)
    if unknown:
        parser.error(f"unknown measure(s) {', '.join(sorted(unknown))}; choose from {', '.join(MEASURES)}")
    return args


def micro_rows(args, hvd, tf) -> list[dict]:
    """latency, grouped and busbw rows, timed as ours_bench.py times ours."""
    p = hvd.size()
    token = tf.zeros(1)
    sync = {"barrier": lambda: hvd.allreduce(token, name="peers.barrier", op=hvd.Sum),
            "slowest": lambda t: float(np.max(hvd.allgather(tf.constant([t], tf.float64),
                                                            name="peers.slowest").numpy()))}
    points = {"latency": [(timing.SMALL, 1)], "grouped": [(timing.GROUPED[0] * timing.GROUPED[1], timing.GROUPED[0])],
              "busbw": [(s, 1) for s in timing.SIZES if s <= args.max_bytes]}
    records = []
    for measure in (m for m in args.measure_list if m != "training"):
        for nbytes, tensors in points[measure]:
            ts = [tf.ones(nbytes // tensors // 4, tf.float32) for _ in range(tensors)]
            name = f"peers.{measure}.{nbytes}"
            if measure == "grouped":
                def call():
                    return hvd.grouped_allreduce(ts, op=hvd.Average)
            else:
                def call():
                    return [hvd.allreduce(ts[0], name=name, op=hvd.Average)]
            for y in call():                       # ones averaged are ones
                if not np.array_equal(y.numpy(), np.ones(y.shape, np.float32)):
                    raise SystemExit(f"horovod_bench: horovod returned a wrong average at {measure} {nbytes} B")
            iters, warmup, repeats = timing.plan(measure, nbytes, quick=args.quick)
            t = timing.timed_together({"horovod": call}, iters=iters, warmup=warmup, repeats=repeats, **sync)
            records.append(timing.record(measure, "horovod", nbytes, tensors, t["horovod"], p))
            if hvd.rank() == 0:
                print(f"[peers] horovod {measure} {nbytes} B done", file=sys.stderr, flush=True)
    return records


def build_model(tf, image_size: int = 32, width: int = 16):
    """examples/synthetic_benchmark.py's small CNN (about 0.3 M parameters), in tf.keras (Keras 2)."""
    layers, w = tf.keras.layers, width
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([
        tf.keras.Input((image_size, image_size, 3)),
        layers.Conv2D(w, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(2 * w, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(4 * w, 3, padding="same", activation="relu"), layers.GlobalAveragePooling2D(),
        layers.Dense(256, activation="relu"), layers.Dense(1000)])


def training(args, hvd, tf) -> dict:
    """Images/sec with Horovod's timing loop: warmup batches, then num_iters timings."""
    rank, size = hvd.rank(), hvd.size()
    shape = (args.batch_size, 32, 32, 3)
    data = tf.constant(np.random.default_rng(rank).random(shape, np.float32))
    target = tf.constant(np.random.default_rng(rank).integers(0, 1000, args.batch_size))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, optimizer = build_model(tf), tf.keras.optimizers.SGD(0.01)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step()                                         # builds the variables, then rank 0's go everywhere
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables(), root_rank=0)
    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        rates.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start))
        if rank == 0:
            print(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank", flush=True)
    mean, conf = float(np.mean(rates)), float(1.96 * np.std(rates))
    if rank == 0:
        print(f"horovod: img/sec per rank: {mean:.1f} +-{conf:.1f}\n"
              f"horovod: total img/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}", flush=True)
    return {"np": size, "horovod": {"per_rank": mean, "total": size * mean, "conf": conf},
            "tensorflow": tf.__version__, "keras": tf.keras.__version__}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
        import horovod
        import horovod.tensorflow as hvd
    except ImportError as exc:
        print(f"# skipped horovod: horovod.tensorflow is not importable ({exc}); "
              "bash benchmarks/peers/build_horovod.sh, then run this with .venv-horovod/bin/python", flush=True)
        return 0
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    hvd.init()
    out: dict = {"impl": "horovod", "horovod": horovod.__version__, "tensorflow": tf.__version__,
                 # what Horovod can put between a gradient and its allreduce (verdict.hooks_goal)
                 "compressors": sorted(n for n in vars(hvd.Compression) if not n.startswith("_"))}
    if any(m != "training" for m in args.measure_list):
        out["records"] = micro_rows(args, hvd, tf)
        if hvd.rank() == 0:
            print("\n".join(timing.format_table(out["records"])), flush=True)
    if "training" in args.measure_list:
        out["training"] = training(args, hvd, tf)
    if hvd.rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
