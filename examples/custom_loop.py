"""A custom training loop: ``DistributedGradientTape`` inside a ``tf.function`` (Horovod's tensorflow2_mnist.py).

::

    python examples/custom_loop.py
    mpirun -np 2 python examples/custom_loop.py            # same global batch, half each
    mpirun -np 2 python examples/custom_loop.py --hooks    # allreduce overlapped with backprop

Data: the 8x8 handwritten digits (examples/digits.py), shuffled once, sharded by rank.
Before the first step every rank takes rank 0's weights and optimizer state
(``broadcast_variables``); after it, the averaged gradients keep them equal.
With ``--hooks`` the gradients go through :class:`tfops.GradientHooks`:
each one is handed to the engine the moment backprop produces it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfops as hvd  # noqa: E402   (was: import horovod.tensorflow as hvd)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from keras_digits import build_model, load_data  # noqa: E402


def main(argv=None) -> float:
    """Train; return the test accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hooks", action="store_true", help="overlap the allreduce with backprop")
    args = parser.parse_args(argv)

    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    x, y, x_test, y_test = load_data(seed=0)
    x, y = x[rank::size], y[rank::size]
    per_rank = args.batch_size // size
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(per_rank, drop_remainder=True)

    model = build_model(seed=rank)                 # different on every rank until the broadcast
    optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hooks = hvd.GradientHooks(model) if args.hooks else None

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            if hooks is None:
                loss = loss_fn(yb, model(xb, training=True))
            else:
                with hooks.forward():
                    loss = loss_fn(yb, model(xb, training=True))
        if hooks is None:
            grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        else:
            grads = hooks.wait(tape.gradient(loss, model.trainable_variables))
        optimizer.apply(grads, model.trainable_variables)
        return loss

    hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    start = time.perf_counter()
    for step, (xb, yb) in enumerate(data.take(args.steps)):
        loss = train_step(xb, yb)
        if step % 50 == 0 and rank == 0:
            print(f"step {step:4d}  loss {float(loss):.4f}")
    elapsed = time.perf_counter() - start

    accuracy = float(np.mean(np.argmax(model(x_test).numpy(), axis=1) == y_test))
    if rank == 0:
        print(f"ranks {size}  {args.steps} steps in {elapsed:.1f} s  test accuracy {accuracy:.4f}"
              f"  ({'hooks' if hooks else 'DistributedGradientTape'})")
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
