"""Large batches on the 8x8 handwritten digits: plain SGD, the linear scaling rule, warmup, LARS and LAMB.

::

    allreduce-run -np 2 python examples/large_batch.py --quick          # 5 batch sizes, 30 epochs
    allreduce-run -np 2 python examples/large_batch.py                  # 8 batch sizes, 60 epochs
    allreduce-run -np 2 python examples/large_batch.py --tune           # how each lr0 was chosen
    allreduce-run -np 2 python examples/large_batch.py --tiny           # the test's smoke run

One model (an MLP, 64-128-64-10) is trained from the same initial weights, on the same data (1436
8x8 digits, shipped with the project: examples/digits.py; 360 held out), for the same number of epochs,
at every global batch size, by five methods. A fixed number of epochs is the point: a batch k times
larger makes k times fewer steps, and the question is how much accuracy each method keeps.

    method   optimizer        rate at global batch B (B0 = 16 the base batch, k = B / B0)
    sgd      SGD, momentum    lr0, whatever B is
    linear   SGD, momentum    lr0 * k                            (the linear scaling rule)
    warmup   SGD, momentum    lr0 -> lr0 * k over the first warmup epochs  (Goyal et al. 2017)
    lars     tfops LARS       lr0 -> lr0 * sqrt(k), the same warmup       (You et al. 2017)
    lamb     keras Lamb       lr0 -> lr0 * sqrt(k), the same warmup       (You et al. 2019)

Each optimizer's lr0 is the best of a small grid at B0, by test loss (``--tune`` reruns that
choice); nothing is tuned per batch size. LARS and LAMB normalise each layer's step
to a fraction of its weights, so their rate is that fraction: it grows with sqrt(k), as LAMB's
authors do, where k times would move every layer by tens of percent a step
(``--scaling linear`` shows it). The warmup is the project's own
:class:`tfops.keras.callbacks.LearningRateScheduleCallback` with Goyal's linear ramp, applied
batch by batch. Every rank takes ``B / size`` samples a step from its own shard
(``x[rank::size]``), reshuffled every epoch with a fixed seed, and
:func:`tfops.DistributedOptimizer` averages the gradients, so one step sees B samples.

Prints a table (test accuracy per method, steps per run) and draws accuracy against global batch
to ``--plot`` (default /tmp/large-batch.png).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import digits  # noqa: E402   (this folder: the data, shipped with the project)
import tfops.keras as hvd  # noqa: E402
from large_batch_plot import draw  # noqa: E402   (this folder, TensorFlow-free: docs/figures/make.py uses it too)
from tfops.optimizers import LARS  # noqa: E402

BASE_BATCH = 16


@dataclass(frozen=True)
class Method:
    """How one method trains at global batch B: its optimizer, base rate, scaling and warmup."""
    name: str
    make: Callable[[float], keras.optimizers.Optimizer]
    lr0: float              # the rate at BASE_BATCH: the lowest test loss of ``grid`` there (--tune)
    grid: tuple             # the base rates --tune tries
    scaling: str            # "none", "linear" or "sqrt": rate = lr0, lr0 * k or lr0 * sqrt(k)
    warmup: bool            # ramp lr0 -> the scaled rate over the first warmup epochs

    def rate(self, batch: int) -> float:
        k = batch / BASE_BATCH
        return self.lr0 * {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[self.scaling]


def _sgd(lr):
    return keras.optimizers.SGD(lr, momentum=0.9)


def _lars(lr):
    return LARS(lr, momentum=0.9, weight_decay=1e-4, eta=0.001)


def _lars_all(lr):
    """LARS that adapts the biases too (--lars-adapt-vectors): excluded, they step at the global rate."""
    return LARS(lr, momentum=0.9, weight_decay=1e-4, eta=0.001, exclude_vectors=False)


def _lamb(lr):
    return keras.optimizers.Lamb(lr)


SGD_GRID, LARS_GRID, LAMB_GRID = (0.01, 0.03, 0.1), (0.125, 0.25, 0.5, 1.0), (0.001, 0.003, 0.01)
# lr0: the lowest test loss of each grid at batch 16 (--tune --quick, -np 2) on the VM the lab was first run on;
# another CPU's rounding ranks the grid differently (0.03, 0.125, 0.003): lesson 15 shows both runs
METHODS = (Method("sgd", _sgd, 0.1, SGD_GRID, "none", False),
           Method("linear", _sgd, 0.1, SGD_GRID, "linear", False),
           Method("warmup", _sgd, 0.1, SGD_GRID, "linear", True),
           Method("lars", _lars, 1.0, LARS_GRID, "sqrt", True),
           Method("lamb", _lamb, 0.001, LAMB_GRID, "sqrt", True))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 718, 1436],
                        help="global batch sizes")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=[m.name for m in METHODS], choices=[m.name for m in METHODS])
    parser.add_argument("--lr0", type=float, default=None, help="every chosen method's base rate instead of its own")
    parser.add_argument("--scaling", choices=["none", "linear", "sqrt"], help="every chosen method's rate rule")
    parser.add_argument("--lars-adapt-vectors", action="store_true",
                        help="LARS gives the biases a trust ratio too, instead of a plain step at its global rate")
    parser.add_argument("--quick", action="store_true", help="batches 16 64 256 512 1436, 30 epochs")
    parser.add_argument("--tiny", action="store_true", help="batches 16 and 512, 1 epoch (a smoke test)")
    parser.add_argument("--tune", action="store_true", help="try each optimizer's lr0 grid at the base batch")
    parser.add_argument("--plot", default="/tmp/large-batch.png", help="where rank 0 draws the figure ('' for none)")
    parser.add_argument("--json", default="", help="where rank 0 writes the results (docs/figures/make.py draws them)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.epochs = [16, 64, 256, 512, 1436], 30
    if args.tiny:
        args.batches, args.epochs, args.warmup_epochs = [16, 512], 1, 1
    return args


def load_data(seed: int):
    """(x_train, y_train, x_test, y_test): 80/20 split of the shuffled digits, pixels in [0, 1]."""
    return digits.split(seed)


def build_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)       # the same initial weights on every rank, for every run
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def warmup_callback(method: Method, batch: int, warmup_epochs: int, steps_per_epoch: int):
    """Goyal et al.'s gradual warmup: lr0 to the scaled rate, linearly, batch by batch."""
    peak = method.rate(batch)
    start = method.lr0 / peak

    def multiplier(epoch: float) -> float:
        done = min((epoch + 1.0 / steps_per_epoch) / warmup_epochs, 1.0)   # this batch's end, in epochs
        return start + (1.0 - start) * done
    return hvd.callbacks.LearningRateScheduleCallback(peak, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                                                      staircase=False, steps_per_epoch=steps_per_epoch)


def train_one(method: Method, batch: int, data, args) -> tuple[float, float, int]:
    """Train a fresh model with ``method`` at global ``batch``; return (test accuracy, test loss, steps)."""
    x, y, x_test, y_test = data
    size, rank = hvd.size(), hvd.rank()
    local = batch // size
    shard_x, shard_y = x[rank::size], y[rank::size]
    steps_per_epoch = len(shard_y) // local
    keras.utils.set_random_seed(args.seed)   # every run draws the same shuffles, whatever ran before it
    dataset = (tf.data.Dataset.from_tensor_slices((shard_x, shard_y))
               .shuffle(len(shard_y), seed=args.seed + rank, reshuffle_each_iteration=True)
               .batch(local, drop_remainder=True))
    model = build_model(args.seed)
    lr = method.lr0 if method.warmup else method.rate(batch)
    model.compile(optimizer=hvd.DistributedOptimizer(method.make(lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if method.warmup and method.rate(batch) != method.lr0:
        callbacks.append(warmup_callback(method, batch, args.warmup_epochs, steps_per_epoch))
    model.fit(dataset, epochs=args.epochs, callbacks=callbacks, shuffle=False, verbose=0)
    logits = model(x_test, training=False)          # eager: no evaluate() function to trace
    loss = keras.losses.sparse_categorical_crossentropy(y_test, logits, from_logits=True)
    accuracy = np.mean(np.argmax(logits, axis=1) == y_test)
    return float(accuracy), float(np.mean(loss)), steps_per_epoch * args.epochs


def tune(methods: list[Method], data, args) -> None:
    """Train each optimizer at the base batch with every rate of its grid; rank 0 prints the accuracies."""
    seen, rows = set(), []
    for m in methods:
        if m.make in seen:
            continue                    # linear and warmup are sgd at the base batch (k = 1)
        seen.add(m.make)
        for lr0 in m.grid:
            accuracy, loss, _ = train_one(replace(m, lr0=lr0), BASE_BATCH, data, args)
            rows.append((m, lr0, accuracy, loss))
    if hvd.rank() == 0:
        print(f"# command: {_command()}")
        print(f"# lr0 at the base batch {BASE_BATCH}, {args.epochs} epochs; best = lowest test loss "
              "(accuracy ties too often); * = the lab's lr0")
        print(f"{'optimizer':<10} {'lr0':>6} {'accuracy':>8} {'loss':>7}")
        for m, lr0, accuracy, loss in rows:
            best = min(rows, key=lambda row: row[3] if row[0].make is m.make else math.inf)[1]
            print(f"{m.make.__name__.strip('_'):<10} {lr0:>6g} {accuracy:8.3f} {loss:7.4f}"
                  f"{' *' if lr0 == m.lr0 else '  '} {'best' if lr0 == best else ''}".rstrip())


def _command() -> str:
    return f"allreduce-run -np {hvd.size()} python examples/large_batch.py {' '.join(sys.argv[1:])}".rstrip()


def record_of(results: dict, methods: list[Method], batches: list[int], steps: dict, args) -> dict:
    """The run as plain data: what --json writes and large_batch_plot.draw reads."""
    return {"command": _command(), "ranks": hvd.size(), "epochs": args.epochs, "warmup_epochs": args.warmup_epochs,
            "base_batch": BASE_BATCH, "n_train": args.n_train, "n_test": args.n_test, "batches": batches,
            "steps": [steps[b] for b in batches],
            "methods": {m.name: {"lr0": m.lr0, "scaling": m.scaling, "warmup": m.warmup} for m in methods},
            "accuracy": {m.name: [results[m.name, b] for b in batches] for m in methods}}


def print_table(record: dict, seconds: float) -> None:
    print(f"# command: {record['command']}")
    print(f"# digits: {record['n_train']} train / {record['n_test']} test samples; same initial weights; base "
          f"batch {BASE_BATCH}; test accuracy after {record['epochs']} epochs")
    print("# lr0 (rate at the base batch) and its rule: " +
          ", ".join(f"{name} {m['lr0']:g} {m['scaling']}" for name, m in record["methods"].items()))
    names = list(record["accuracy"])
    print(f"{'global batch':>12} {'steps':>6} " + " ".join(f"{name:>7}" for name in names))
    for i, (b, s) in enumerate(zip(record["batches"], record["steps"])):
        print(f"{b:>12} {s:>6} " + " ".join(f"{record['accuracy'][name][i]:7.3f}" for name in names))
    print(f"# trained in {seconds:.0f} s")


def main(argv=None) -> None:
    args = parse_args(argv)
    # Two ranks share the cores and the model is tiny: one thread each beats contention.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.get_logger().setLevel("ERROR")       # each run traces a new training step; that is expected here
    hvd.init()
    size = hvd.size()
    bad = [b for b in args.batches if b % size or b < size]
    if bad:
        raise SystemExit(f"rank {hvd.rank()}: global batches {bad} are not multiples of the {size} ranks")
    x, y, x_test, y_test = load_data(args.seed)
    usable = len(y) // size * size               # equal shards: every rank runs the same steps
    data = (x[:usable], y[:usable], x_test, y_test)
    if max(args.batches) > usable:
        raise SystemExit(f"rank {hvd.rank()}: global batch {max(args.batches)} is more than the {usable} samples")
    args.n_train, args.n_test = usable, len(y_test)
    methods = [m for m in METHODS if m.name in args.methods]
    if args.lr0 is not None:
        methods = [replace(m, lr0=args.lr0) for m in methods]
    if args.scaling is not None:
        methods = [replace(m, scaling=args.scaling) for m in methods]
    if args.lars_adapt_vectors:
        methods = [replace(m, make=_lars_all) if m.make is _lars else m for m in methods]
    if args.tune:
        tune(methods, data, args)
        hvd.shutdown()
        return
    batches = sorted(args.batches)
    results, steps, done = {}, {}, {}
    start = time.perf_counter()
    for b in batches:
        for m in methods:
            # at the base batch linear and warmup are sgd (k = 1): the same run, trained once
            same = (b, m.make, m.lr0, m.rate(b), m.warmup and m.rate(b) != m.lr0)
            if same not in done:
                done[same] = train_one(m, b, data, args)
            results[m.name, b], _, steps[b] = done[same]
    if hvd.rank() == 0:
        record = record_of(results, methods, batches, steps, args)
        print_table(record, time.perf_counter() - start)
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
            print(f"# record: {args.json}")
        if args.plot:
            draw(record, args.plot)
            print(f"# plot: {args.plot}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
