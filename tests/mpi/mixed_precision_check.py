"""Rank script: mixed_float16 loss scaling with a distributed optimizer, in both wrapping orders.

Run alone and under mpirun by tests/test_tf_rank_scripts.py, through tests/mpi/tf_keras_parity.py
(one launch per world size: ``run()`` at its end), and by hand::

    python tests/mpi/mixed_precision_check.py
    allreduce-run -np 2 python tests/mpi/mixed_precision_check.py

Checks (tfops/training/mixed_precision.py), with SGD and with Adam:

1. ``model.fit`` under ``mixed_float16``: ``LossScaleOptimizer(DistributedOptimizer(opt))`` and
   ``DistributedOptimizer(LossScaleOptimizer(opt))`` come out as the same structure and train
   bitwise alike; both match plain ``LossScaleOptimizer(opt)`` on the global batch (one process:
   bitwise; p ranks: within fp16 rounding, and the weights moved 20x that tolerance, so a run
   whose gradients were unscaled twice, which does not move with SGD, fails). The same for
   ``ShardedOptimizer`` in both orders (SGD).
2. A rank-local overflow: the last rank's gradient gets an inf at step 1 of 3. Every rank skips
   that step (iterations, the halved scale, the weights: the same on every rank, and the
   step left them unchanged), eager and in a ``tf.function`` (the second order, the same
   structure, eagerly), for ``DistributedOptimizer`` and ``ShardedOptimizer``.
Prints "mixed_precision_check OK" on every rank.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tfops  # noqa: E402

LSO = keras.optimizers.LossScaleOptimizer
STEPS, BATCH = 4, 8
OPTIMIZERS = {"SGD": lambda: keras.optimizers.SGD(0.05), "Adam": lambda: keras.optimizers.Adam(0.01)}


def _model(seed=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4),
                             keras.layers.Activation("linear", dtype="float32")])


def _data(p):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((STEPS, p, BATCH, 6)).astype(np.float32)
    y = rng.integers(0, 4, (STEPS, p, BATCH))
    return x, y


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fit(opt, x, y):
    model = _model()
    model.compile(optimizer=opt, loss=_loss(), jit_compile=False)
    model.fit(x, y, batch_size=len(x) // STEPS, epochs=1, shuffle=False, verbose=0)
    return model


def _weights(model):
    return [np.asarray(w, np.float64) for w in model.get_weights()]


def _same_everywhere(values, what, me):
    everyone = tfops.allgather_object(values)
    for r, theirs in enumerate(everyone):
        for a, b in zip(theirs, everyone[0], strict=True):
            assert np.array_equal(a, b), f"rank {me}: {what}: rank {r} differs from rank 0"


def _orders(wrap):
    return {"LSO(wrapper(opt))": lambda make: LSO(wrap(make())), "wrapper(LSO(opt))": lambda make: wrap(LSO(make()))}


def check_fit(p, me):
    x, y = _data(p)
    mine_x, mine_y = x[:, me].reshape(-1, 6), y[:, me].reshape(-1)
    for opt_name, make in OPTIMIZERS.items():
        reference = _weights(_fit(LSO(make()), x.reshape(-1, 6), y.reshape(-1)))     # the global batch
        start = _weights(_model())
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, start))
        tol = 0 if p == 1 else moved / 20
        for wrap_name, wrap in (("DistributedOptimizer", tfops.DistributedOptimizer),
                                ("ShardedOptimizer", tfops.ShardedOptimizer)):
            if wrap_name == "ShardedOptimizer" and opt_name == "Adam":
                continue        # the same wrapping code; SGD is the case loss scaled twice shows (Adam barely)
            results = {}
            for order, build in _orders(wrap).items():
                model = _fit(build(make), mine_x, mine_y)
                assert type(model.optimizer) is LSO, (me, wrap_name, order, type(model.optimizer))
                inner = model.optimizer.inner_optimizer
                assert type(inner).__name__.startswith(wrap_name.replace("Optimizer", "")), (me, order, type(inner))
                results[order] = _weights(model)
                for got, want in zip(results[order], reference):
                    np.testing.assert_allclose(got, want, rtol=0, atol=tol,
                                               err_msg=f"rank {me}: {wrap_name} {order} {opt_name} vs plain LSO")
            a, b = results.values()
            assert all(np.array_equal(u, v) for u, v in zip(a, b)), f"rank {me}: {wrap_name} orders differ ({opt_name})"
            _same_everywhere(a, f"{wrap_name} {opt_name} weights", me)


def _run_loop(opt, p, me, poison_step, in_function):
    x, y = _data(p)
    model = _model()
    loss_fn = _loss()

    def step(xb, yb, poison):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        grads[0] = grads[0] + tf.where(poison, np.float32(np.inf), np.float32(0))   # inf on one rank only
        opt.apply_gradients(zip(grads, model.trainable_variables))
    if in_function:
        step = tf.function(step, jit_compile=False)
    record = []
    for s in range(3):
        poison = tf.constant(s == poison_step and me == p - 1)
        step(tf.constant(x[s, me]), tf.constant(y[s, me]), poison)
        record.append((int(opt.iterations.numpy()), float(opt.dynamic_scale.numpy()), _weights(model)))
    return record


def check_overflow(p, me):
    for wrap_name, wrap in (("DistributedOptimizer", tfops.DistributedOptimizer),
                            ("ShardedOptimizer", tfops.ShardedOptimizer)):
        for order, build in _orders(wrap).items():
            # both orders are one structure (check_fit): the second order once, eagerly
            for in_function in (False, True) if order.startswith("LSO") else (False,):
                what = f"{wrap_name} {order} {'tf.function' if in_function else 'eager'}"
                got = _run_loop(build(OPTIMIZERS["SGD"]), p, me, 1, in_function)
                (i0, s0, w0), (i1, s1, w1), (i2, s2, w2) = got
                assert (i0, i1, i2) == (1, 1, 2), f"rank {me}: {what}: iterations {i0, i1, i2}, want 1, 1, 2"
                assert s1 == s0 / 2 and s2 == s1, f"rank {me}: {what}: scale {s0, s1, s2}, want halved once"
                assert all(np.array_equal(a, b) for a, b in zip(w0, w1)), f"rank {me}: {what}: step 1 not skipped"
                _same_everywhere([np.array([i1, s1])] + w1 + w2, what, me)


def run():
    p, me = tfops.size(), tfops.rank()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        check_fit(p, me)
        check_overflow(p, me)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"rank {me}: mixed_precision_check OK", flush=True)


if __name__ == "__main__":
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tfops.init()
    run()
    tfops.shutdown()
