"""tfops.optimizers.LARS against a numpy float64 reference, in one process.

The reference is written from the paper's Algorithm 1 (and LARC's clip mode), independently of the
optimizer's code: several steps on a kernel, a bias, a 4-d conv kernel, a zero-initialised kernel
and a vector-shaped scale, with momentum, Nesterov, weight decay and clipping.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfops.optimizers import LARS  # noqa: E402

SHAPES = {"kernel": (3, 3), "bias": (3,), "conv": (2, 3, 3, 4), "zeros": (4, 2), "gamma": (6,)}


def reference_lars(weights, grads_per_step, *, lr, momentum=0.9, nesterov=False, weight_decay=0.0, eta=0.001,
                   epsilon=1e-8, clip=False, adapted=None, decayed=None):
    """float64 LARS on dicts of arrays; ``adapted``/``decayed``: names that get the ratio / the decay.

    ``lr``: one rate, or one per step.
    """
    w = {k: np.array(v, np.float64) for k, v in weights.items()}
    vel = {k: np.zeros_like(v) for k, v in w.items()}
    rates = list(lr) if np.ndim(lr) else [lr] * len(grads_per_step)
    for lr, grads in zip(rates, grads_per_step):
        for k in w:
            g = np.array(grads[k], np.float64)
            beta = weight_decay if k in decayed else 0.0
            rate = lr
            if k in adapted:
                wn, gn = np.linalg.norm(w[k]), np.linalg.norm(g)
                trust = eta * wn / (gn + beta * wn + epsilon) if wn > 0 and gn > 0 else 1.0
                rate = min(trust, lr) if clip else lr * trust
            g = g + beta * w[k]
            vel[k] = momentum * vel[k] + rate * g
            w[k] = w[k] - (momentum * vel[k] + rate * g if nesterov else vel[k])
    return w


def _problem(seed=0, steps=4):
    rng = np.random.default_rng(seed)
    weights = {k: rng.standard_normal(s) * 0.5 for k, s in SHAPES.items()}
    weights["zeros"][:] = 0.0
    grads = [{k: rng.standard_normal(s) * 0.1 for k, s in SHAPES.items()} for _ in range(steps)]
    return weights, grads


def _run_keras(opt, weights, grads_per_step, *, compiled=False, dtype="float64"):
    variables = [keras.Variable(weights[k], dtype=dtype, name=k) for k in SHAPES]

    def step(grads):
        opt.apply([tf.constant(grads[k], dtype) for k in SHAPES], variables)
    run = tf.function(step) if compiled else step
    for grads in grads_per_step:
        run(grads)
    return {k: v.numpy() for k, v in zip(SHAPES, variables)}


def _assert_close(got, want, rtol):
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=rtol * 1e-2, err_msg=f"variable {k!r}")


# matrices and the 4-d kernel are adapted; "bias" and "gamma" (rank 1) are excluded by default
ADAPTED = {"kernel", "conv", "zeros"}


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_matches_numpy_reference(momentum, nesterov, clip, weight_decay):
    weights, grads = _problem()
    lr, eta = (0.5, 0.02) if clip else (2.0, 0.01)      # clip mode: eta is a rate; one that clips sometimes
    opt = LARS(lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, eta=eta, clip_trust_ratio=clip)
    got = _run_keras(opt, weights, grads)
    want = reference_lars(weights, grads, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                          eta=eta, clip=clip, adapted=ADAPTED, decayed=ADAPTED)
    _assert_close(got, want, 1e-12)
    # the trust ratio must matter: plain SGD (every variable unadapted) lands elsewhere
    sgd = reference_lars(weights, grads, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         eta=eta, clip=clip, adapted=set(), decayed=ADAPTED)
    assert not np.allclose(got["kernel"], sgd["kernel"], rtol=1e-3)


def test_clipping_caps_the_rate_at_lr():
    """Big weights, tiny gradients (trust 100): unclipped LARS steps 100x lr; clipped, exactly lr (SGD)."""
    weights, grads = _problem()
    weights["kernel"], grads[0]["kernel"] = np.full((3, 3), 10.0), np.full((3, 3), 1e-3)
    lr = 0.125                                   # exact in the optimizer's float32 rate variable
    got = _run_keras(LARS(lr, momentum=0.0, eta=0.01, clip_trust_ratio=True), weights, grads[:1])
    np.testing.assert_allclose(got["kernel"], 10.0 - lr * 1e-3, rtol=1e-12)
    got = _run_keras(LARS(lr, momentum=0.0, eta=0.01), weights, grads[:1])
    trust = 0.01 * 30.0 / (3e-3 + 1e-8)
    np.testing.assert_allclose(got["kernel"], 10.0 - lr * trust * 1e-3, rtol=1e-12)


def test_exclusion_by_name_and_without_vectors():
    weights, grads = _problem(seed=1)
    opt = LARS(1.0, weight_decay=0.01, eta=0.01, exclude_vectors=False, exclude_from_layer_adaptation=["conv"],
               exclude_from_weight_decay=["kernel", "gamma"])
    got = _run_keras(opt, weights, grads)
    want = reference_lars(weights, grads, lr=1.0, weight_decay=0.01, eta=0.01,
                          adapted={"kernel", "bias", "zeros", "gamma"}, decayed={"bias", "conv", "zeros"})
    _assert_close(got, want, 1e-12)


def test_exclusion_by_variable_method():
    weights, grads = _problem(seed=2, steps=2)
    opt = LARS(1.0, eta=0.01)
    variables = [keras.Variable(weights[k], dtype="float64", name=k) for k in SHAPES]
    opt.exclude_from_layer_adaptation(var_list=[variables[0]])        # "kernel"
    for g in grads:
        opt.apply([tf.constant(g[k]) for k in SHAPES], variables)
    want = reference_lars(weights, grads, lr=1.0, eta=0.01, adapted={"conv", "zeros"}, decayed=set())
    _assert_close({k: v.numpy() for k, v in zip(SHAPES, variables)}, want, 1e-12)
    with pytest.raises(ValueError, match="before the optimizer is built"):
        opt.exclude_from_layer_adaptation(var_names=["bias"])


def test_tf_function_float32_and_a_changed_learning_rate():
    """Traced once, run with two rates (as a warmup callback sets them): float32 within 1e-5."""
    weights, grads = _problem(seed=3, steps=4)
    opt = LARS(0.5, nesterov=True, weight_decay=1e-3, eta=0.01)
    variables = [keras.Variable(weights[k], dtype="float32", name=k) for k in SHAPES]
    opt.build(variables)                 # (a first call that creates variables is traced twice)
    step = tf.function(lambda gs: opt.apply(gs, variables))
    for i, g in enumerate(grads):
        opt.learning_rate = 0.5 if i < 2 else 1.5
        step([tf.constant(g[k], "float32") for k in SHAPES])
    assert step.experimental_get_tracing_count() == 1
    want = reference_lars(weights, grads, lr=[0.5, 0.5, 1.5, 1.5], nesterov=True, weight_decay=1e-3, eta=0.01,
                          adapted=ADAPTED, decayed=ADAPTED)
    _assert_close({k: v.numpy() for k, v in zip(SHAPES, variables)}, want, 1e-5)


def test_model_fit_step_matches_reference():
    """One full-batch model.fit step (traced training step) equals the reference on the same gradient."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).standard_normal((32, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    before = {v.path: v.numpy().astype(np.float64) for v in model.trainable_variables}
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    grads = {v.path: g.numpy() for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables))}
    model.compile(optimizer=LARS(1.0, weight_decay=1e-4, eta=0.01), loss=loss_fn, jit_compile=False)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    kernels = {p for p, w in before.items() if w.ndim > 1}
    want = {p: w for p, w in reference_lars(before, [grads], lr=1.0, weight_decay=1e-4, eta=0.01,
                                            adapted=kernels, decayed=kernels).items()}
    for v in model.trainable_variables:
        np.testing.assert_allclose(v.numpy(), want[v.path], rtol=1e-5, atol=1e-7, err_msg=v.path)


def test_config_round_trip_and_keras_serialisation():
    opt = LARS(0.3, momentum=0.8, nesterov=True, weight_decay=5e-4, eta=0.02, epsilon=1e-6, clip_trust_ratio=True,
               exclude_vectors=False, exclude_from_weight_decay=["bias"], exclude_from_layer_adaptation=["norm"],
               clipnorm=1.0)
    config = opt.get_config()
    assert config["weight_decay"] == 5e-4 and config["exclude_from_layer_adaptation"] == ["norm"]
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is LARS and again.get_config() == config
    assert LARS.from_config(config).get_config() == config


def test_bad_arguments_are_named():
    for kwargs, word in [({"momentum": 1.0}, "momentum"), ({"weight_decay": -1.0}, "weight_decay"),
                         ({"eta": 0.0}, "eta"), ({"epsilon": -1e-9}, "epsilon")]:
        with pytest.raises(ValueError, match=f"LARS: {word}"):
            LARS(**kwargs)
