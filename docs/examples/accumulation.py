"""Lesson 15: gradient accumulation, a batch larger than memory holds, as one step.

    allreduce-run -np 2 python docs/examples/accumulation.py

Each rank runs 4 micro-batches of 8 per update (``backward_passes_per_step=4``,
``average_aggregated_gradients=True``): an update on 4 x 8 x 2 = 64 samples. Three updates
(12 backward passes) are compared with plain SGD on one process at batch 64.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tfops  # noqa: E402

N, MICRO, UPDATES = 4, 8, 3


def model():
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)])


def step(net, opt, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((net(x) - y) ** 2)            # a mean over this micro-batch
    opt.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)


def main():
    tfops.init()
    p, me = tfops.size(), tfops.rank()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((UPDATES, N, p, MICRO, 10)).astype(np.float32)   # [update, pass, rank, sample]
    y = x[..., :1] * 2 - x[..., 1:2]

    net = model()
    opt = tfops.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=N,
                                     average_aggregated_gradients=True)
    for u in range(UPDATES):
        for k in range(N):
            step(net, opt, x[u, k, me], y[u, k, me])

    reference = model()                                       # one process, batch N * p * MICRO
    plain = keras.optimizers.SGD(0.1)
    for u in range(UPDATES):
        step(reference, plain, x[u].reshape(-1, 10), y[u].reshape(-1, 1))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(net.get_weights(), reference.get_weights()))
    if me == 0:
        print(f"{p} ranks x {N} passes x micro-batch {MICRO} = batch {N * p * MICRO} per update")
        print(f"backward passes {UPDATES * N}, optimizer.iterations {int(opt.iterations.numpy())} (Horovod's: it counts passes)")
        print(f"largest weight difference from one process at batch {N * p * MICRO}: {diff:.1e}")
    tfops.shutdown()


if __name__ == "__main__":
    main()
