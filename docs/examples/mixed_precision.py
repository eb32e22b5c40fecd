"""Lesson 6: 16 bits in the compute (mixed precision, loss scaling) against 16 bits on the wire.

    allreduce-run -np 2 python docs/examples/mixed_precision.py

Every rank trains the same small classifier on its half of each batch, 8 steps of SGD(0.05),
and rank 0 prints the final loss on the whole data set of each way to train:

* float32, then fp16 on the wire only (``compression=tfops.Compression.fp16``);
* mixed_float16 (float16 compute, float32 variables, loss scaling) with the
  ``LossScaleOptimizer`` outside and inside ``DistributedOptimizer``, and the plain
  ``LossScaleOptimizer`` on one process over the global batch (the reference);
* mixed_bfloat16 (bfloat16 compute: float32's range, so no loss scaling).

Then one overflow: rank 1's gradient gets an inf at step 2; every rank skips that step and
halves the loss scale.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tfops  # noqa: E402

STEPS, BATCH = 8, 16
LSO = keras.optimizers.LossScaleOptimizer


def model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(5),
                             keras.layers.Activation("linear", dtype="float32")])   # the loss in float32


def data(p):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS, p, BATCH, 10)).astype(np.float32)
    y = (x[..., :5].argmax(-1) + (x[..., 5] > 1)) % 5                       # a rule the model can learn
    return x, y


def train(policy, make_opt, x, y):
    keras.mixed_precision.set_global_policy(policy)
    net = model()
    net.compile(optimizer=make_opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=False)
    net.fit(x.reshape(-1, 10), y.reshape(-1), batch_size=x.shape[-2], epochs=1, shuffle=False, verbose=0)
    return net


def main():
    tfops.init()
    p, me = tfops.size(), tfops.rank()
    x, y = data(p)
    mine = (x[:, me], y[:, me])
    sgd = lambda: keras.optimizers.SGD(0.05)                                   # noqa: E731
    runs = [("float32", "float32", lambda: tfops.DistributedOptimizer(sgd())),
            ("fp16 on the wire", "float32", lambda: tfops.DistributedOptimizer(sgd(), compression=tfops.Compression.fp16)),
            ("mixed_float16, LSO(Distributed(SGD))", "mixed_float16", lambda: LSO(tfops.DistributedOptimizer(sgd()))),
            ("mixed_float16, Distributed(LSO(SGD))", "mixed_float16", lambda: tfops.DistributedOptimizer(LSO(sgd()))),
            ("mixed_bfloat16", "mixed_bfloat16", lambda: tfops.DistributedOptimizer(sgd()))]
    whole = (x.reshape(-1, 10), y.reshape(-1))
    for name, policy, make in runs:
        net = train(policy, make, *mine)
        loss = net.evaluate(*whole, verbose=0)
        if me == 0:
            print(f"{name:38s} optimizer {type(net.optimizer).__name__:26s} loss {loss:.4f}")
    if me == 0:                   # the reference: one process, the global batch, plain loss scaling
        net = train("mixed_float16", lambda: LSO(sgd()), x.reshape(STEPS, -1, 10)[:, None], y.reshape(STEPS, -1)[:, None])
        print(f"{'mixed_float16, LSO(SGD), one process':38s} optimizer {'LossScaleOptimizer':26s} "
              f"loss {net.evaluate(*whole, verbose=0):.4f}")

    keras.mixed_precision.set_global_policy("mixed_float16")        # a custom loop with one bad step
    net, opt = model(), LSO(tfops.DistributedOptimizer(sgd()))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for step in range(3):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss_fn(mine[1][step], net(mine[0][step], training=True)))
        grads = tape.gradient(scaled, net.trainable_variables)
        if step == 2 and me == 1:
            grads[0] = grads[0] + np.float32(np.inf)                 # an overflow on rank 1 only
        opt.apply_gradients(zip(grads, net.trainable_variables))
        seen = tfops.allgather_object((int(opt.iterations.numpy()), float(opt.dynamic_scale.numpy())))
        if me == 0:
            print(f"step {step}: steps applied per rank {[s for s, _ in seen]}, loss scale per rank "
                  f"{[f'{scale:.0f}' for _, scale in seen]}")
    tfops.shutdown()


if __name__ == "__main__":
    main()
