"""Rank script: tfops with communication hooks (comm_hook=), in model.fit, custom loops and tf.function.

Run by tests/test_tf_rank_scripts.py as ``mpirun -np 2 python tf_comm_hooks.py [--digits]`` (through tf_in_turn.py).
Every rank trains from the same weights on its own data; the reference is the same training
with the plain allreduce (no hook), in the same process. Checks, in order:

1. ``DistributedOptimizer(comm_hook=PowerSGD(rank >= every matrix side, min_compression_rate=0,
   start_iter=0))`` in ``model.fit``: every kernel goes through P and Q, and a full-rank P Q^T is
   the average itself: the weights equal the plain run's (float32 rounding);
2. the same in ``model.fit`` with ``PowerSGD(rank=1)``, in a custom loop inside ``tf.function``
   with ``DistributedGradientTape(comm_hook=OneBit())``, eagerly with PowerSGD(rank=1), and
   with ``GradientHooks(comm_hook=...)``: the weights are bitwise identical across ranks, differ
   from the plain run's (the hook ran, and compresses) and stay finite;
3. inside ``tf.function`` with buckets of 256 bytes (tfops.training.overlap): several submits per step,
   the hook runs on every gradient exactly once per step (a recording hook wraps PowerSGD);
4. ``--digits``: examples/keras_digits.py trains to within 1.5 points of the uncompressed test
   accuracy with PowerSGD rank 2 and with OneBit (same steps and seeds).
Prints "tf_comm_hooks OK" on every rank at the end.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import allreduce as ar  # noqa: E402
import tfops  # noqa: E402
import tfops.keras as hvd  # noqa: E402
from tfops.training import overlap  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import keras_digits  # noqa: E402

hvd.init()
p, me = hvd.size(), hvd.rank()
# Regression on random targets, 32 samples a rank: every gradient matrix is well conditioned, so a
# full-rank P Q^T (Gram-Schmidt in float32) reproduces it to float32 rounding. (A classifier's last
# hidden layer has near rank-deficient gradients, where float32 Gram-Schmidt loses ~1e-3.)
B, STEPS = 32, 4
rng = np.random.default_rng(100 + me)                   # each rank its own data
X = rng.standard_normal((STEPS * B, 6)).astype(np.float32)
Y = rng.standard_normal((STEPS * B, 12)).astype(np.float32)
LOSS = keras.losses.MeanSquaredError()


def mlp() -> keras.Model:
    keras.utils.set_random_seed(3)                      # the same initial weights on every rank
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(12)])


def fit(**kw) -> list[np.ndarray]:
    model = mlp()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw), loss=LOSS, jit_compile=False)
    model.fit(X, Y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    return [w.copy() for w in model.get_weights()]


def loop(graph: bool, **kw) -> list[np.ndarray]:
    model, opt = mlp(), keras.optimizers.SGD(0.1)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        tape = tfops.DistributedGradientTape(tape, **kw)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    step = tf.function(step) if graph else step
    for s in range(STEPS):
        step(tf.constant(X[s * B:(s + 1) * B]), tf.constant(Y[s * B:(s + 1) * B]))
    return [v.numpy().copy() for v in model.trainable_variables]


def hooked(comm_hook) -> list[np.ndarray]:
    model, opt = mlp(), keras.optimizers.SGD(0.1)
    hooks = tfops.GradientHooks(model, comm_hook=comm_hook)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            with hooks.forward():
                loss = LOSS(y, model(x, training=True))
        opt.apply(hooks.wait(tape.gradient(loss, model.trainable_variables)), model.trainable_variables)
    for s in range(STEPS):
        step(tf.constant(X[s * B:(s + 1) * B]), tf.constant(Y[s * B:(s + 1) * B]))
    return [v.numpy().copy() for v in model.trainable_variables]


def same_everywhere(ws: list[np.ndarray], what: str) -> None:
    everyone = ar.allgather_object([w.tobytes() for w in ws])
    assert all(theirs == everyone[0] for theirs in everyone), f"{what}: weights differ across ranks"


def compressed(ws, ref, what: str) -> None:
    """Identical on every rank, finite, and not the plain run's: the hook ran and compressed."""
    same_everywhere(ws, what)
    assert all(np.isfinite(w).all() for w in ws), f"{what}: non-finite weights"
    gap = max(float(np.abs(a - b).max()) for a, b in zip(ws, ref))
    assert gap > 1e-4, f"{what}: the weights equal the uncompressed run's (gap {gap:.1e}): did the hook run?"


def full_rank() -> ar.PowerSGD:
    return ar.PowerSGD(rank=16, start_iter=0, min_compression_rate=0)


# 1. full rank in model.fit: the plain average, up to float32 rounding. 1e-4 on weights of ~0.3
# after 4 steps: the warm-started Q carries the last gradient's scales, so P's condition number
# is about the product of two steps' and float32 Gram-Schmidt lost up to 2.4e-5 here (by hand);
# a gradient sent to the wrong variable, or summed instead of averaged, is off by ~1e-2.
TOL = 1e-4
plain_fit = fit()
got = fit(comm_hook=full_rank())
same_everywhere(got, "fit, full-rank PowerSGD")
for a, b in zip(got, plain_fit):
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg="fit, full-rank PowerSGD != plain allreduce")

# 2. low rank / 1 bit: fit, tape in tf.function, eager tape, GradientHooks
compressed(fit(comm_hook=tfops.PowerSGD(rank=1, start_iter=0)), plain_fit, "fit, PowerSGD rank 1")
plain_loop = loop(graph=True)
for a, b in zip(plain_loop, loop(graph=True, comm_hook=full_rank())):
    np.testing.assert_allclose(b, a, rtol=0, atol=TOL, err_msg="tf.function tape, full-rank PowerSGD")
compressed(loop(graph=True, comm_hook=tfops.OneBit()), plain_loop, "tf.function tape, OneBit")
compressed(loop(graph=False, comm_hook=tfops.PowerSGD(rank=1, start_iter=0)), plain_loop, "eager tape, PowerSGD")
compressed(hooked(tfops.PowerSGD(rank=1, start_iter=0)), plain_loop, "GradientHooks, PowerSGD")


# 3. overlap stays: several buckets per step, the hook sees every gradient once per step
class Recording(ar.CommHook):
    """PowerSGD, recording the names of each bucket it is given."""

    def __init__(self, inner):
        self.inner, self.name, self.seen = inner, "Recording+" + inner.name, []

    def reduce(self, bucket, comm, state):
        self.seen += list(bucket.names)
        return self.inner.reduce(bucket, comm, state)


overlap.BUCKET_BYTES, saved = 256, overlap.BUCKET_BYTES      # 4 gradients of 48-576 bytes: 3 buckets
recording = Recording(ar.PowerSGD(rank=1, start_iter=0))
compressed(loop(graph=True, comm_hook=recording), plain_loop, "tf.function tape, 1 KiB buckets")
overlap.BUCKET_BYTES = saved
n_vars = len(mlp().trainable_variables)
assert len(recording.seen) == STEPS * n_vars and len(set(recording.seen)) == n_vars, recording.seen
groups = {name.split("+group")[0] for name in recording.seen}
assert len(groups) > 1, f"one bucket only: {sorted(groups)}"

# 4. digits: PowerSGD rank 2 and OneBit within 1.5 points of uncompressed, same steps and seeds
if "--digits" in sys.argv:
    accuracy = {}
    for hook in ("none", "powersgd", "onebit"):
        args = keras_digits.parse_args(["--comm-hook", hook, "--powersgd-rank", "2"])
        accuracy[hook] = keras_digits.train(args)
    if me == 0:
        print("digits test accuracy: " + ", ".join(f"{k} {v:.4f}" for k, v in accuracy.items()), flush=True)
    for hook in ("powersgd", "onebit"):
        assert accuracy[hook] >= accuracy["none"] - 0.015, f"digits: {hook} {accuracy[hook]:.4f} against " \
                                                           f"uncompressed {accuracy['none']:.4f}"

print(f"rank {me}: tf_comm_hooks OK", flush=True)
hvd.shutdown()
