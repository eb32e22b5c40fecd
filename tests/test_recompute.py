"""Activation recompute (issue 44, part 2): selective_recompute here, one process; every distributed
path under mpirun (tests/mpi/recompute_check.py, in tests/test_tf_parallel_scripts.py's -np 2
launch: gradients unchanged and reduced once with keras.RematScope, keras.remat and
selective_recompute under DistributedOptimizer, GradientHooks and ShardedOptimizer stages 1-3; the
tensor-parallel layers and a 2-stage pipeline)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import tfops  # noqa: E402,F401  (installs the hook-aware keras.remat)
from tfops.parallel.recompute import selective_recompute  # noqa: E402

def _core(q, k, v):
    return tf.nn.softmax(q @ tf.transpose(k, [0, 2, 1]) / 2.0) @ v


@pytest.mark.parametrize("graph", [False, True])
def test_selective_recompute_gradient_is_the_functions_and_it_runs_again(graph):
    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.standard_normal((2, 5, 4)), tf.float64) for _ in range(3))
    calls = []

    def core(q, k, v):
        calls.append(1)
        return _core(q, k, v)

    def grads(f):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            y = tf.reduce_sum(tf.sin(f(q, k, v)))
        return tape.gradient(y, [q, k, v])
    run = (lambda f: tf.function(lambda: grads(f))()) if graph else grads
    want = run(core)
    plain_calls, calls[:] = len(calls), []
    got = run(selective_recompute(core))
    assert len(calls) == 2 * plain_calls              # the forward, and again in backprop
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)


def test_selective_recompute_refuses_a_function_that_reads_variables():
    w = tf.Variable(2.0, name="w_inside")
    with pytest.raises(ValueError, match="w_inside"):
        selective_recompute(lambda x: x * w)(tf.ones([3]))


def test_remat_scope_full_trains_in_a_tf_function():
    # Keras' own remat (tf.recompute_grad) raises on the training=/mask= keywords a RematScope layer's
    # call gets inside a tf.function; tfops' replacement closes over them (tfops/training/remat.py)
    def grads(remat):
        keras.utils.set_random_seed(1)
        with keras.RematScope(mode="full" if remat else None):
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                                      keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        x = tf.constant(np.random.default_rng(2).standard_normal((5, 3)), tf.float32)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(model(x, training=True) ** 2)
            return tape.gradient(y, model.trainable_variables)
        return step()
    for a, b in zip(grads(True), grads(False)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("graph", [False, True])
def test_remat_replays_the_forwards_dropout_mask_and_advances_the_seed_once(graph):
    # tf.recompute_grad (Keras' own remat) drew a new mask in backprop: gradients off by O(1)
    def grads(remat):
        keras.utils.set_random_seed(1)
        dense, drop = keras.layers.Dense(4), keras.layers.Dropout(0.5, seed=3)
        x = tf.constant(np.random.default_rng(2).standard_normal((5, 3)), tf.float32)
        dense.build((None, 3))

        def block(h):
            return drop(tf.tanh(dense(h)), training=True)

        def step():
            with tf.GradientTape() as tape:
                y = tf.reduce_sum((keras.remat(block) if remat else block)(x) ** 2)
            return tape.gradient(y, dense.trainable_variables)
        step = tf.function(step) if graph else step
        return [g.numpy() for _ in range(2) for g in step()], drop.seed_generator.state.numpy()
    (got, seed_got), (want, seed_want) = grads(True), grads(False)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(seed_got, seed_want)
