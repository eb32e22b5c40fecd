"""Rank script: activation recompute with every distributed path (issue 44, part 2), at any world size.

``mpirun -np P python recompute_check.py``, run by tests/test_recompute.py at P = 2. Each rank
trains on its own seeded batches; a model with recompute and the same model without it start
from the same weights. Checks, for ``keras.RematScope(mode="full")``, ``keras.remat`` inside a
layer's ``call`` and ``tfops.parallel.selective_recompute`` (the attention core of a small
attention block), in a ``tf.function`` (RematScope eagerly too):

1. DistributedOptimizer, GradientHooks (through ``DistributedOptimizer(hooks=)``) and
   ShardedOptimizer stages 1, 2 and 3 (``fully_shard``): 3 Adam steps with recompute equal the
   same steps without it (float32 rounding), bitwise the same on every rank (stage 3: each
   rank's pieces equal).
2. Every gradient is reduced once: the elements each step hands to the engine (allreduce,
   grouped allreduce, the hooks' submits) or to the sharded reduce-scatters (stages 1-2's
   buckets, stage 3's units) equal the model's parameter count, with recompute as without.
3. Recompute recomputes: the function under keras.remat / selective_recompute runs more often
   with recompute than without (again in backprop).
Prints "rank R: recompute_check OK" at the end.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import allreduce as ar  # noqa: E402
import tfops  # noqa: E402
from tfops.parallel.recompute import selective_recompute  # noqa: E402
from tfops.sharding import exchange, unit_exchange  # noqa: E402
from tfops.sharding.fully_shard import fully_shard  # noqa: E402

tfops.init()
p, me = tfops.size(), tfops.rank()
K = keras.optimizers
CALLS = {"block": 0}


class Block(keras.layers.Layer):
    """Dense -> tanh -> Dense, the tanh part through ``keras.remat`` when ``remat``."""

    def __init__(self, width, remat=False, **kw):
        super().__init__(**kw)
        self.a, self.b, self.remat = keras.layers.Dense(width), keras.layers.Dense(width), remat

    def call(self, x):
        def inner(h):
            CALLS["block"] += 1
            return self.b(tf.tanh(self.a(h)))
        return (keras.remat(inner) if self.remat else inner)(x)


class Attention(keras.layers.Layer):
    """One head of self-attention; the core (softmax(q k^T) v) through ``selective_recompute``."""

    def __init__(self, width, recompute=False, **kw):
        super().__init__(**kw)
        self.qkv, self.out, self.recompute = keras.layers.Dense(3 * width), keras.layers.Dense(width), recompute

    def call(self, x):
        q, k, v = tf.split(self.qkv(x), 3, axis=-1)

        def core(q, k, v):
            CALLS["block"] += 1
            return tf.nn.softmax(q @ tf.transpose(k, [0, 2, 1]) / 4.0) @ v
        return self.out(selective_recompute(core)(q, k, v) if self.recompute else core(q, k, v))


def build(kind: str, recompute: bool):
    keras.utils.set_random_seed(7)
    if kind == "RematScope":
        scope = keras.RematScope(mode="full") if recompute else keras.RematScope(mode=None)
        with scope:
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    elif kind == "keras.remat":
        model = keras.Sequential([keras.Input((6,)), Block(8, remat=recompute), keras.layers.Dense(3)])
    else:
        model = keras.Sequential([keras.Input((5, 6)), Attention(6, recompute=recompute), keras.layers.Dense(3)])
    return model


def batches(kind: str):
    rng = np.random.default_rng(50 + me)
    shape = (4, 5, 6) if kind == "selective" else (4, 6)
    return [(rng.standard_normal(shape).astype("f4"), rng.standard_normal(shape[:-1] + (3,)).astype("f4"))
            for _ in range(3)]


REDUCED = {"elements": 0}


def _counting(fn, arrays_of):
    def wrapped(*args, **kwargs):
        REDUCED["elements"] += sum(int(np.size(a)) for a in arrays_of(args, kwargs))
        return fn(*args, **kwargs)
    return wrapped


ar.allreduce_async = _counting(ar.allreduce_async, lambda a, k: [a[0]])
ar.grouped_allreduce = _counting(ar.grouped_allreduce, lambda a, k: a[0])
ar.grouped_allreduce_async = _counting(ar.grouped_allreduce_async, lambda a, k: a[0])
exchange.reducescatter_bucket = _counting(exchange.reducescatter_bucket, lambda a, k: [a[0]])
unit_exchange._ring_reducescatter = _counting(unit_exchange._ring_reducescatter, lambda a, k: [a[1]])


def make(path: str, model):
    if path == "DistributedOptimizer":
        return tfops.DistributedOptimizer(K.Adam(0.05))
    if path == "GradientHooks":
        return tfops.DistributedOptimizer(K.Adam(0.05), hooks=tfops.GradientHooks(model))
    return tfops.ShardedOptimizer(K.Adam(0.05), stage=int(path[-1]), **({"bucket_bytes": 64} if path != "stage3" else {}))


def train(path: str, kind: str, recompute: bool, graph: bool):
    """(final weights (this rank's pieces at stage 3), elements reduced per step, parameters)."""
    model = build(kind, recompute)
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if path == "stage3":
        fully_shard(model)
    opt = make(path, model)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    step = tf.function(step) if graph else step
    REDUCED["elements"] = 0
    for x, y in batches(kind):
        step(tf.constant(x), tf.constant(y))
    per_step = REDUCED["elements"] / 3
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables]), per_step, n


PATHS = ["DistributedOptimizer", "GradientHooks", "stage1", "stage2", "stage3"]
for kind in ("RematScope", "keras.remat", "selective"):
    for path in PATHS:
        for graph in ((False, True) if kind == "RematScope" else (True,)):   # RematScope eagerly too
            CALLS["block"] = 0
            want, reduced_plain, n = train(path, kind, False, graph)
            calls_plain, CALLS["block"] = CALLS["block"], 0
            got, reduced, _ = train(path, kind, True, graph)
            what = f"rank {me}: {kind} {path} {'tf.function' if graph else 'eager'}"
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
            everyone = tfops.allgather_object(got.tobytes())
            assert path == "stage3" or all(e == everyone[0] for e in everyone), f"{what}: ranks differ"
            assert reduced == reduced_plain == n, f"{what}: {reduced} elements reduced per step with recompute, " \
                                                  f"{reduced_plain} without, {n} parameters"
            if kind != "RematScope":                   # the inside runs again in backprop (traced once per step fn)
                assert CALLS["block"] > calls_plain, f"{what}: {CALLS['block']} calls, {calls_plain} without"
            print(f"{what}: max |recompute - plain| = {np.abs(got - want).max():.1e}, {reduced:.0f} of {n} "
                  "elements reduced per step", flush=True)
print(f"rank {me}: recompute_check OK", flush=True)
tfops.shutdown()
