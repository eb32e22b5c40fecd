"""Rank script: tfops.ShardedOptimizer (issue 33) against DistributedOptimizer, at any world size.

``mpirun -np P python sharding_check.py DIR [LOAD_FROM]``, run by tests/test_sharding.py at
P = 2, 3, 4. Each rank trains on its own seeded batches. Checks:

1. Every optimizer (SGD momentum/Nesterov, Adam, AdamW with name and variable exclusions,
   RMSprop, Adagrad, Adamax, Nadam, Lion, Lamb, Adam + global_clipnorm, SGD + clipnorm), stage 1
   and 2, 10 steps: the weights equal DistributedOptimizer's to float32 rounding and are
   bitwise identical across ranks; the gathered Adam state equals the unsharded Adam's slots.
   Buckets of 64 bytes, so every step runs several reduce-scatters with uneven counts, and
   58 parameters, which p = 4 does not divide. At -np 2 Adam and Lamb inside tf.function, the
   others eagerly (model.fit below runs the tf.function path at every size). Stage 2 here with
   a 1-byte bound on the gradients in flight, so every hand-over waits for the ring before it.
   Every one-variable bucket takes the path of a large variable (``gather.REPLACE_BYTES = 1``:
   the variable emptied before its allgather, then assigned), here and in 2 and 5.
2. model.fit with BroadcastGlobalVariablesCallback and MetricAverageCallback (and that callback
   again once the optimizer is built: it leaves each rank's shard alone); then model.save
   and tf.train.Checkpoint write DIR/model.keras and DIR/ckpt (every rank calls save; rank 0's
   path is the real one) with DIR/state.npz, the state gathered by hand.
3. With LOAD_FROM (the files of a run at another rank count): load both files into a sharded
   optimizer here (re-sharded) and into a plain Adam; both equal LOAD_FROM/state.npz.
4. Bad input raises on every rank: a different model on the last rank (MismatchError before any
   step), Adafactor / Muon / LARS (TypeError naming them), gradients of a DistributedGradientTape,
   eager and in a tf.function (ValueError).
5. At -np 4, ``process_set=``: two sets of 2 ranks, each trains its own data (stage 1 Adam with
   global_clipnorm eagerly, stage 2 Lamb in a tf.function: the norms' allreduce runs over the set
   too) and equals DistributedOptimizer(process_set=) over its set; the sets differ from each
   other; a rank outside the set gets ValueError naming it; a list instead of a set, TypeError.
Prints "rank R: sharding_check OK" at the end.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import tfops  # noqa: E402
import tfops.keras as hvd  # noqa: E402
from tfops.errors import MismatchError  # noqa: E402
from tfops.sharding import exchange, gather  # noqa: E402

hvd.init()
gather.REPLACE_BYTES = 1          # every one-variable bucket emptied before its allgather (issue 44), eager and traced
p, me = hvd.size(), hvd.rank()
OUT = sys.argv[1]
LOAD_FROM = sys.argv[2] if len(sys.argv) > 2 else None
K = keras.optimizers


def model(swap=False):
    keras.utils.set_random_seed(3)
    widths = (4, 3) if swap else (5, 3)
    return keras.Sequential([keras.Input((7,)), keras.layers.Dense(widths[0], activation="tanh"),
                             keras.layers.Dense(widths[1])])


class Tiny:
    """The same two layers as model(), as bare variables: an eager step without Keras' layer calls."""

    def __init__(self):
        keras.utils.set_random_seed(3)
        init = np.random.default_rng(3)
        shapes = [(7, 5), (5,), (5, 3), (3,)]
        self.trainable_variables = [keras.Variable(init.standard_normal(s).astype("f4") * 0.5, name=n)
                                    for s, n in zip(shapes, ["kernel", "bias", "kernel", "bias"])]

    def __call__(self, x):
        w1, b1, w2, b2 = self.trainable_variables
        return tf.tanh(tf.convert_to_tensor(x) @ w1 + b1) @ w2 + b2


def adamw():
    opt = K.AdamW(0.02, weight_decay=0.3)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


OPTIMIZERS = [("SGD nesterov", lambda: K.SGD(0.1, momentum=0.9, nesterov=True)), ("Adam", lambda: K.Adam(0.02)),
              ("AdamW", adamw), ("RMSprop", lambda: K.RMSprop(0.01, momentum=0.5, centered=True)),
              ("Adagrad", lambda: K.Adagrad(0.1)), ("Adamax", lambda: K.Adamax(0.02)), ("Nadam", lambda: K.Nadam(0.02)),
              ("Lion", lambda: K.Lion(0.01)), ("Lamb", lambda: K.Lamb(0.02)),
              ("Adam global_clipnorm", lambda: K.Adam(0.02, global_clipnorm=0.05)),
              ("SGD clipnorm", lambda: K.SGD(0.1, clipnorm=0.02))]
GRAPH = {"Adam", "Lamb"} if p == 2 else set()     # model.fit below runs the graph path at every size


STEPS = 10


def train(opt, m, graph, steps=STEPS):
    rng = np.random.default_rng(100 + me)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
    step = tf.function(step) if graph else step
    for _ in range(steps):
        step(rng.standard_normal((4, 7)).astype("f4"), rng.standard_normal((4, 3)).astype("f4"))
    return np.concatenate([v.numpy().ravel() for v in m.trainable_variables])


def same_everywhere(a: np.ndarray, what: str) -> None:
    everyone = hvd.allgather_object(a.tobytes())
    bad = [r for r, b in enumerate(everyone) if b != everyone[0]]
    assert not bad, f"rank {me}: {what}: ranks {bad} differ bitwise from rank 0"


def gathered(opt) -> list:
    state = opt._gathered()
    return [state.gather(i, s) for i, s in state.order]


# 1. every optimizer against DistributedOptimizer ------------------------------------------
# stage 2 with a 1-byte bound on the gradients in flight: every bucket's hand-over waits for the
# ring before it (eager, and in a tf.function, where the backprop after it waits too)
exchange.IN_FLIGHT_BYTES, in_flight_default = 1, exchange.IN_FLIGHT_BYTES
for k, (name, make) in enumerate(OPTIMIZERS):
    stage = 1 + k % 2
    graph = name in GRAPH
    ref_opt = hvd.DistributedOptimizer(make())
    want = train(ref_opt, Tiny(), graph)
    opt = tfops.ShardedOptimizer(make(), stage=stage, bucket_bytes=64)
    got = train(opt, Tiny(), graph)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"rank {me}: {name} stage {stage}")
    assert np.abs(got - train(make(), Tiny(), graph, steps=0)).max() > 1e-3, f"{name}: the weights did not move"
    same_everywhere(got, name)
    assert int(opt.iterations.numpy()) == STEPS, f"rank {me}: {name}: iterations {opt.iterations.numpy()}"
    if name == "Adam":
        for g, w in zip(gathered(opt), ref_opt.inner_optimizer.variables[2:]):
            np.testing.assert_allclose(g, w.numpy(), rtol=2e-5, atol=1e-7, err_msg=f"rank {me}: Adam state")
    print(f"rank {me}: {name} stage {stage} {'tf.function' if graph else 'eager'}: max |sharded - "
          f"DistributedOptimizer| = {np.abs(got - want).max():.2e}", flush=True)

exchange.IN_FLIGHT_BYTES = in_flight_default

# 2. model.fit with the usual callbacks, then both checkpoint formats ------------------------
m = model()
opt = hvd.ShardedOptimizer(K.Adam(0.01))
m.compile(optimizer=opt, loss="mse", jit_compile=False)
data = np.random.default_rng(5)
x, y = data.standard_normal((64, 7)).astype("f4"), data.standard_normal((64, 3)).astype("f4")
history = m.fit(x[me::p], y[me::p], batch_size=4, epochs=2, verbose=0,
                callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
assert len(history.history["loss"]) == 2 and int(opt.iterations.numpy()) == 2 * (64 // p // 4 + (64 // p % 4 > 0))
same_everywhere(np.concatenate([v.numpy().ravel() for v in m.trainable_variables]), "model.fit weights")
state = gathered(opt)
again = hvd.callbacks.BroadcastGlobalVariablesCallback(0)       # a second fit: the optimizer is built now
again.set_model(m)
again.on_train_begin()
for before, after in zip(state, gathered(opt)):                 # rank 0's slots must not land on the others
    np.testing.assert_array_equal(before, after, err_msg=f"rank {me}: a broadcast changed the sharded state")
where = OUT if me == 0 else os.path.join(OUT, f"rank{me}")
os.makedirs(where, exist_ok=True)
m.save(os.path.join(where, "model.keras"))
tf.train.Checkpoint(model=m, optimizer=opt).write(os.path.join(where, "ckpt"))
if me == 0:
    np.savez(os.path.join(OUT, "state.npz"), iterations=opt.iterations.numpy(), *state)
print(f"rank {me}: model.fit, model.save and tf.train.Checkpoint at -np {p}", flush=True)

# 3. load another rank count's files -------------------------------------------------------
if LOAD_FROM:
    saved = np.load(os.path.join(LOAD_FROM, "state.npz"))
    want = [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]
    for fmt in ("keras", "ckpt"):
        for plain in (False, True):
            m2 = model()
            o2 = K.Adam(0.01) if plain else tfops.ShardedOptimizer(K.Adam(0.01))
            o2.build(m2.trainable_variables)
            if fmt == "keras":
                m2.compile(optimizer=o2, loss="mse", jit_compile=False)
                m2.load_weights(os.path.join(LOAD_FROM, "model.keras"))
            else:
                tf.train.Checkpoint(model=m2, optimizer=o2).read(os.path.join(LOAD_FROM, "ckpt")).expect_partial()
            got = [v.numpy() for v in o2.variables[2:]] if plain else gathered(o2)
            assert int(o2.iterations.numpy()) == int(saved["iterations"]), f"rank {me}: {fmt}: iterations"
            assert len(got) == len(want), f"rank {me}: {fmt}: {len(got)} state tensors, saved {len(want)}"
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"rank {me}: {fmt} plain={plain}")
    print(f"rank {me}: loaded the files of another rank count (keras and tf.train.Checkpoint, sharded and plain)",
          flush=True)

# 4. bad input -----------------------------------------------------------------------------
try:
    train(tfops.ShardedOptimizer(K.Adam(0.01)), model(swap=me == p - 1), False, steps=1)
    raise AssertionError(f"rank {me}: different models did not raise")
except MismatchError as e:
    assert f"rank {p - 1}" in str(e), str(e)
for bad in (K.Adafactor(), K.Muon(), tfops.optimizers.LARS(0.1)):
    try:
        tfops.ShardedOptimizer(bad)
        raise AssertionError(f"{type(bad).__name__} did not raise")
    except TypeError as e:
        assert type(bad).__name__ in str(e), str(e)
m3, o3 = model(), tfops.ShardedOptimizer(K.SGD(0.1))


@tf.function
def tape_step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(m3(x))
    tape = hvd.DistributedGradientTape(tape)
    o3.apply_gradients(zip(tape.gradient(loss, m3.trainable_variables), m3.trainable_variables))


for how, run in [("tf.function", tape_step), ("eager", tape_step.python_function)]:
    try:
        run(np.ones((2, 7), "f4"))
        raise AssertionError(f"DistributedGradientTape's gradients did not raise ({how})")
    except ValueError as e:
        assert "DistributedGradientTape" in str(e), str(e)
# 5. process_set= (-np 4 only: two data-parallel groups of 2, as a Mesh's data_set) -------------
if p == 4:
    groups = [tfops.add_process_set([0, 1]), tfops.add_process_set([2, 3])]    # every rank, same order
    mine, other = groups[me // 2], groups[1 - me // 2]
    for name, stage, graph in (("Adam global_clipnorm", 1, False), ("Lamb", 2, True)):
        make = dict(OPTIMIZERS)[name]
        want = train(hvd.DistributedOptimizer(make(), process_set=mine), Tiny(), graph)
        opt = tfops.ShardedOptimizer(make(), stage=stage, bucket_bytes=64, process_set=mine)
        got = train(opt, Tiny(), graph)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"rank {me}: {name} over {mine}")
        assert opt._shards[0].per_rank in (58 // 2, 58 // 2 + 1), f"rank {me}: not sharded over the set's 2 ranks"
        everyone = hvd.allgather_object(got.tobytes())
        assert everyone[me ^ 1] == everyone[me], f"rank {me}: {name}: the other rank of {mine} differs"
        assert everyone[(me + 2) % 4] != everyone[me], f"rank {me}: {name}: the two sets trained alike"
    try:
        tfops.ShardedOptimizer(K.SGD(0.1), process_set=other).build(Tiny().trainable_variables)
        raise AssertionError(f"rank {me}: building over a set it is not in did not raise")
    except ValueError as e:
        assert f"rank {me}" in str(e) and "not in" in str(e), str(e)
    try:
        tfops.ShardedOptimizer(K.SGD(0.1), process_set=[0, 1])
        raise AssertionError(f"rank {me}: a list as process_set did not raise")
    except TypeError as e:
        assert "ProcessSet" in str(e), str(e)
    print(f"rank {me}: process_set= over {mine}: equal to DistributedOptimizer over the set (stage 1 eager, "
          "stage 2 tf.function)", flush=True)
print(f"rank {me}: sharding_check OK", flush=True)
hvd.shutdown()
