"""Rank script: ``tfops.join()`` and ``op=tfops.Adasum``, eager, in ``tf.function`` and in a
``DistributedGradientTape`` training loop. Run by tests/test_tf_rank_scripts.py at -np 2.

Rank r has 3 + r batches; when it runs out it joins, and the other ranks go on with its zeros:
an averaged gradient is the active ranks' sum over the full size (Horovod's rule), an Adasum
one the active rank's own (adasum(g, 0) = g). Every value is checked against numpy on every rank.
Prints "rank R: tf_join_adasum OK".
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import tfops  # noqa: E402
import tfops.keras as hvd  # noqa: E402
from allreduce.algorithms import adasum  # noqa: E402

tfops.init()
p, me = tfops.size(), tfops.rank()
assert p == 2, "run at -np 2 (Adasum needs a power of two)"
STEPS = [3 + r for r in range(p)]


def x_of(r, step, n=4):
    return (np.arange(n, dtype=np.float32) + 3 * r - step) * (1 if r % 2 else -1)


def active(step):
    return [r for r in range(p) if step < STEPS[r]]


# 1. uneven steps, eager and in tf.function, then join (eager / in a tf.function)
fn_allreduce = tf.function(lambda x: tfops.allreduce(x, name="fn.avg"))
fn_join = tf.function(lambda: tfops.join())
for mode, reduce, join in [("eager", lambda x, s: tfops.allreduce(x, name=f"eager.{s}"), tfops.join),
                           ("tf.function", lambda x, s: fn_allreduce(x), fn_join)]:
    for step in range(STEPS[me]):
        y = reduce(tf.constant(x_of(me, step)), step)
        want = sum(x_of(r, step) for r in active(step)) / p
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, err_msg=f"{mode} step {step}")
    last = join()
    assert last.dtype == tf.int32 and int(last) == p - 1, f"{mode}: join returned {last}"

# 2. Adasum: values, grouped, gradient (parallel upstream gradients c0 u, c1 u: (c0 + c1) / 2 u)
xs = [np.random.default_rng(r).standard_normal(33).astype(np.float32) for r in range(p)]
fn_adasum = tf.function(lambda x: tfops.allreduce(x, op=tfops.Adasum, name="fn.ada"))
for mode, run in [("eager", lambda x: tfops.allreduce(x, op=tfops.Adasum)), ("tf.function", fn_adasum)]:
    np.testing.assert_allclose(run(tf.constant(xs[me])).numpy(), adasum.reference(xs), rtol=1e-5, atol=1e-6,
                               err_msg=mode)
ys = tfops.grouped_allreduce([tf.constant(xs[me][:5]), tf.constant(xs[me])], op=tfops.Adasum)
np.testing.assert_allclose(ys[0].numpy(), adasum.reference([x[:5] for x in xs]), rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(ys[1].numpy(), adasum.reference(xs), rtol=1e-5, atol=1e-6)
v = tf.Variable(xs[me])
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tfops.allreduce(v, op=tfops.Adasum)) * (me + 1)
np.testing.assert_allclose(tape.gradient(loss, v).numpy(), np.full(33, (1 + 2) / 2), rtol=1e-6)
hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)    # accepted, as Horovod's

# 3. a DistributedGradientTape training loop with uneven data (Average, then Adasum), joining at the end
for op in (tfops.Average, tfops.Adasum):
    w1, w2 = tf.Variable(np.zeros(4, np.float32)), tf.Variable(np.zeros((2, 3), np.float32))
    sgd = keras.optimizers.SGD(0.5)

    @tf.function
    def train_step(a, b):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w1 * a) + tf.reduce_sum(w2 * b)      # gradients: a and b
        grads = tfops.DistributedGradientTape(tape, op=op).gradient(loss, [w1, w2])
        sgd.apply_gradients(zip(grads, [w1, w2]))
        return grads

    expect1, expect2 = np.zeros(4), np.zeros((2, 3))
    for step in range(STEPS[me]):
        a_of = {r: x_of(r, step) for r in range(p)}
        b_of = {r: x_of(r, step + 1, 6).reshape(2, 3) for r in range(p)}
        g1, g2 = train_step(tf.constant(a_of[me]), tf.constant(b_of[me]))
        if op == tfops.Average:
            want1 = sum(a_of[r] for r in active(step)) / p
            want2 = sum(b_of[r] for r in active(step)) / p
        else:                                   # per tensor; a joined rank's zeros leave the other's as is
            want1 = adasum.reference([a_of[r] if r in active(step) else 0 * a_of[r] for r in range(p)])
            want2 = adasum.reference([b_of[r] if r in active(step) else 0 * b_of[r] for r in range(p)]).reshape(2, 3)
        np.testing.assert_allclose(g1.numpy(), want1, rtol=1e-5, atol=1e-6, err_msg=f"{op!r} step {step}")
        np.testing.assert_allclose(g2.numpy(), want2, rtol=1e-5, atol=1e-6, err_msg=f"{op!r} step {step}")
        expect1 -= 0.5 * want1
        expect2 -= 0.5 * want2
    assert int(tfops.join()) == p - 1
    np.testing.assert_allclose(w1.numpy(), expect1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w2.numpy(), expect2, rtol=1e-5, atol=1e-5)

print(f"rank {me}: tf_join_adasum OK", flush=True)
tfops.shutdown()
