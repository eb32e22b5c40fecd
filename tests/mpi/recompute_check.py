"""Rank script: activation recompute with every distributed path (issue 44, part 2), at any world size.

``mpirun -np P python recompute_check.py``, run by tests/test_recompute.py at P = 2. Each rank
trains on its own seeded batches; a model with recompute and the same model without it start
from the same weights. Checks, for ``keras.RematScope(mode="full")``, ``keras.remat`` inside a
layer's ``call`` and ``tfops.parallel.selective_recompute`` (the attention core of a small
attention block), in a ``tf.function`` (RematScope eagerly too):

1. DistributedOptimizer, GradientHooks (through ``DistributedOptimizer(hooks=)``) and
   ShardedOptimizer stages 1, 2 and 3 (``fully_shard``): 2 steps (Adam in a tf.function, SGD with
   Nesterov momentum eagerly) with recompute equal the same steps of DistributedOptimizer without
   it (float32 rounding; stage 3's gathered whole), bitwise the same on every rank.
2. Every gradient is reduced once: the elements each step hands to the engine (allreduce,
   grouped allreduce, the hooks' submits) or to the sharded reduce-scatters (stages 1-2's
   buckets, stage 3's units) equal the model's parameter count, with recompute as without.
3. Recompute recomputes: the function under keras.remat / selective_recompute runs more often
   with recompute than without (again in backprop).
4. The tensor-parallel layers (``Mesh(tensor=P)``; every rank the same batches): a Column -> Row
   -> Dropout block under ``keras.remat``, and the layers under ``RematScope``, train as without
   recompute (so the dropout mask recomputed in backprop is the forward's), and the row layer's
   forward allreduce runs once more per recompute around it, the same count on every rank.
   At P = 2, a 2-stage 1F1B ``Pipeline`` whose stages' layers were made under ``RematScope``
   trains as without.
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
from tfops.sharding.fully_shard import fully_shard, gathered_weights  # noqa: E402

tfops.init()
p, me = tfops.size(), tfops.rank()
K = keras.optimizers
CALLS = {"block": 0}
STEPS = 2                  # Adam steps a training: a wrong gradient shows at the first


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
            for _ in range(STEPS)]


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


def make(path: str, model, graph: bool):
    """Adam in a tf.function, SGD with Nesterov momentum eagerly (so stage 3 meets both at -np 2 here:
    tests/test_stage3.py runs stage3_check at -np 3 and 4)."""
    inner = K.Adam(0.05) if graph else K.SGD(0.1, momentum=0.9, nesterov=True)
    if path == "DistributedOptimizer":
        return tfops.DistributedOptimizer(inner)
    if path == "GradientHooks":
        return tfops.DistributedOptimizer(inner, hooks=tfops.GradientHooks(model))
    return tfops.ShardedOptimizer(inner, stage=int(path[-1]), **({"bucket_bytes": 64} if path != "stage3" else {}))


def train(path: str, kind: str, recompute: bool, graph: bool):
    """(final weights (gathered whole at stage 3), elements reduced per step, parameters)."""
    model = build(kind, recompute)
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if path == "stage3":
        fully_shard(model)
    opt = make(path, model, graph)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    step = tf.function(step) if graph else step
    REDUCED["elements"] = 0
    for x, y in batches(kind):
        step(tf.constant(x), tf.constant(y))
    per_step = REDUCED["elements"] / STEPS
    weights = gathered_weights(model) if path == "stage3" else [v.numpy() for v in model.trainable_variables]
    return np.concatenate([np.asarray(w).ravel() for w in weights]), per_step, n


PATHS = ["DistributedOptimizer", "GradientHooks", "stage1", "stage2", "stage3"]
for kind in ("RematScope", "keras.remat", "selective"):
    for graph in ((False, True) if kind == "RematScope" else (True,)):   # RematScope eagerly too
        CALLS["block"] = 0                             # the reference: DistributedOptimizer, no recompute
        want, reduced_plain, n = train("DistributedOptimizer", kind, False, graph)
        calls_plain = CALLS["block"]
        assert reduced_plain == n, f"rank {me}: {kind}: {reduced_plain} elements reduced per step, {n} parameters"
        for path in PATHS:
            CALLS["block"] = 0
            got, reduced, _ = train(path, kind, True, graph)
            what = f"rank {me}: {kind} {path} {'tf.function' if graph else 'eager'}"
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
            everyone = tfops.allgather_object(got.tobytes())
            assert all(e == everyone[0] for e in everyone), f"{what}: ranks differ"
            assert reduced == n, f"{what}: {reduced} elements reduced per step with recompute, {n} parameters"
            if kind != "RematScope":                   # the inside runs again in backprop (traced once per step fn)
                assert CALLS["block"] > calls_plain, f"{what}: {CALLS['block']} calls, {calls_plain} without"
            print(f"{what}: max |recompute - DistributedOptimizer without| = {np.abs(got - want).max():.1e}, "
                  f"{reduced:.0f} of {n} elements reduced per step", flush=True)

# 4. the tensor-parallel layers and the pipeline (-np 2: tensor 2, then pipeline 2) ---------------
from tfops.parallel import ColumnParallelDense, Mesh, Pipeline, RowParallelDense, regions  # noqa: E402


class SplitBlock(keras.layers.Layer):
    """Column(tanh) -> Row -> Dropout, as a Megatron MLP; through ``keras.remat`` when ``remat`` (the
    row layer's forward allreduce then runs again in backprop, under the forward's dropout mask)."""

    def __init__(self, mesh, remat=False, **kw):
        super().__init__(**kw)
        self.up, self.down = ColumnParallelDense(8, mesh, activation="tanh"), RowParallelDense(6, mesh)
        self.drop, self.remat = keras.layers.Dropout(0.3, seed=5), remat

    def call(self, x, training=None):
        def inner(h):
            CALLS["block"] += 1
            return self.drop(self.down(self.up(h)), training=training)
        return (keras.remat(inner) if self.remat else inner)(x)


def train_split(kind: str, recompute: bool):
    """(this rank's weights after STEPS Adam steps in a tf.function, tensor allreduces per step); the
    batches are the same on every rank (a tensor group sees one batch)."""
    keras.utils.set_random_seed(7)
    mesh = Mesh(tensor=p)
    if kind == "keras.remat":
        model = keras.Sequential([keras.Input((6,)), SplitBlock(mesh, recompute), keras.layers.Dense(3)])
    else:
        with keras.RematScope(mode="full") if recompute else keras.RematScope(mode=None):
            model = keras.Sequential([keras.Input((6,)), ColumnParallelDense(8, mesh, activation="tanh"),
                                      RowParallelDense(6, mesh), keras.layers.Dropout(0.3, seed=5),
                                      keras.layers.Dense(3)])
    opt = K.Adam(0.05)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    rng = np.random.default_rng(60)                       # not per rank
    regions.reset_counts()
    for _ in range(STEPS):
        step(tf.constant(rng.standard_normal((4, 6)), tf.float32), tf.constant(rng.standard_normal((4, 3)), tf.float32))
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables]), \
        regions.collective_counts().get("allreduce", 0) / STEPS


for kind in ("keras.remat", "RematScope"):
    CALLS["block"] = 0
    want, reduced_plain = train_split(kind, False)
    calls_plain, CALLS["block"] = CALLS["block"], 0
    got, reduced = train_split(kind, True)
    what = f"rank {me}: {kind} tensor {p} tf.function"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
    # plain: the row layer's allreduce forward (g; the column layer's backward f has no input gradient to
    # reduce: the model's input). Each recompute around the row layer runs g once more, in backprop:
    # keras.remat's block once; RematScope twice (the Sequential, made in the scope, and the layer itself)
    again = 1 if kind == "keras.remat" else 2
    assert (reduced_plain, reduced) == (1, 1 + again), \
        f"{what}: tensor allreduces per step {reduced_plain} -> {reduced}, wanted 1 -> {1 + again}"
    assert len(set(tfops.allgather_object((reduced_plain, reduced)))) == 1, f"{what}: ranks ran different collectives"
    assert kind != "keras.remat" or CALLS["block"] > calls_plain, f"{what}: not recomputed"
    print(f"{what}: max |recompute - plain| = {np.abs(got - want).max():.1e}; tensor allreduces per step "
          f"{reduced_plain:.0f} -> {reduced:.0f} (the row layer's forward again in backprop, once a recompute)", flush=True)


def train_pipeline(recompute: bool):
    """This rank's stage weights after 2 Adam steps of a 2-stage 1F1B pipeline (eager, -np 2), the
    stages' layers built under RematScope(mode="full") when ``recompute``."""
    keras.utils.set_random_seed(11)
    with keras.RematScope(mode="full") if recompute else keras.RematScope(mode=None):
        layers = [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8, activation="tanh"),
                  keras.layers.Dense(3)]
    stage = keras.Sequential([keras.Input((6,)), layers[0]] if me == 0 else [keras.Input((8,))] + layers[1:])
    pipe, opt = Pipeline(stage, Mesh(pipeline=2), 2, "1f1b", loss="mse"), K.Adam(0.05)
    rng = np.random.default_rng(70)
    for _ in range(2):
        pipe.train_step(rng.standard_normal((4, 6)).astype("f4"), rng.standard_normal((4, 3)).astype("f4"), opt)
    return np.concatenate([v.numpy().ravel() for v in stage.trainable_variables])


if p == 2:
    want, got = train_pipeline(False), train_pipeline(True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: pipeline")
    print(f"rank {me}: RematScope pipeline 2 (1f1b, stage {me}): max |recompute - plain| = "
          f"{np.abs(got - want).max():.1e}", flush=True)
print(f"rank {me}: recompute_check OK", flush=True)
tfops.shutdown()
