"""Keras ``model.fit`` on the 8x8 handwritten digits, data-parallel with tfops (Horovod's keras_mnist.py).

::

    python examples/keras_digits.py                  # one process
    mpirun -np 2 python examples/keras_digits.py     # two ranks, each trains on its half

The data (1797 8x8 digits, shipped with the project: examples/digits.py) is
shuffled once with a fixed seed and sharded by rank (``x[rank::size]``). The
global batch is fixed, so each rank takes ``batch_size / size`` samples per
step (the remainder of the data that does not fill a global batch is
dropped, so every rank runs the same steps); ``fit(shuffle=False)`` keeps the shards in order, so the p ranks'
batches at step k together are exactly the single-process batch k and every
-np reproduces the one-process run up to float rounding.
``--warmup-epochs N`` adds Goyal et al.'s learning-rate warmup (from lr/size).
``--comm-hook powersgd`` (rank ``--powersgd-rank``) or ``--comm-hook onebit`` sends the gradients
through a communication hook (docs/13-sending-fewer-bytes.md)::

    allreduce-run -np 2 python examples/keras_digits.py --comm-hook powersgd --powersgd-rank 2
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfops.keras as hvd  # noqa: E402   (was: import horovod.tensorflow.keras as hvd)

import digits  # noqa: E402   (this folder: the data, shipped with the project)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--comm-hook", choices=("none", "powersgd", "onebit"), default="none")
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--start-iter", type=int, default=10, help="PowerSGD: uncompressed steps first")
    return parser.parse_args(argv)


def comm_hook(args: argparse.Namespace):
    """The hook ``--comm-hook`` names (a new one per training run: a hook keeps state), or None."""
    if getattr(args, "comm_hook", "none") == "powersgd":
        return hvd.PowerSGD(rank=args.powersgd_rank, start_iter=args.start_iter)
    if getattr(args, "comm_hook", "none") == "onebit":
        return hvd.OneBit()
    return None


def load_data(seed: int):
    """(x_train, y_train, x_test, y_test): 80/20 split of the shuffled digits, pixels in [0, 1]."""
    return digits.split(seed)


def build_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def train(args: argparse.Namespace, *, distributed: bool = True, verbose: int = 0) -> float:
    """Train; return the test accuracy. ``distributed=False`` is the plain single-process run."""
    size, rank = (hvd.size(), hvd.rank()) if distributed else (1, 0)
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {size} ranks")
    x, y, x_test, y_test = load_data(args.seed)
    # Whole global batches only: every rank must run the same number of equal-sized steps.
    usable = len(y) // args.batch_size * args.batch_size
    x, y = x[:usable], y[:usable]
    # Every rank starts from different weights; BroadcastGlobalVariablesCallback makes them rank 0's.
    model = build_model(args.seed + rank)
    optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
    callbacks = []
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, comm_hook=comm_hook(args))
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        if args.warmup_epochs:
            callbacks.append(hvd.callbacks.LearningRateWarmupCallback(args.lr, warmup_epochs=args.warmup_epochs))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    model.fit(x[rank::size], y[rank::size], batch_size=args.batch_size // size, epochs=args.epochs,
              shuffle=False, callbacks=callbacks, verbose=verbose)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return float(accuracy)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    accuracy = train(args, verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        hook = "" if args.comm_hook == "none" else f"  comm hook {comm_hook(args).name}"
        print(f"ranks {hvd.size()}  global batch {args.batch_size}  epochs {args.epochs}{hook}  "
              f"test accuracy {accuracy:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
