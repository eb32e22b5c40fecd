"""Rank script: ZeRO stage 3 (``tfops.fully_shard`` + ``ShardedOptimizer(stage=3)``, issue 44) against
DistributedOptimizer, at any world size.

``mpirun -np P python stage3_check.py DIR [LOAD_FROM]``, run by tests/test_stage3.py at P = 3 then 4,
the second loading the files the first wrote (another rank count); it passes at -np 2 as well. Each rank trains on its
own seeded batches. Checks:

1. Equal: Adam in a tf.function and SGD with Nesterov momentum eagerly, 4 steps of a
   three-layer MLP (74 parameters, which 3 and 4 do not divide): the gathered weights
   equal DistributedOptimizer's within 1e-5 and are bitwise identical across ranks; the
   gathered Adam slots equal the unsharded Adam's. Adam again with every layer built under
   ``keras.RematScope(mode="full")`` (recompute on): equal too, and bitwise across ranks.
2. Memory, counted: every weight, gradient and slot this rank holds is its piece: the pieces
   sum to floor(N/p) or ceil(N/p) elements on every rank and to N over the ranks; each
   gradient has its piece's shape; Adam's two slots are pieces too. After a step every unit's
   status is NOT_AVAILABLE; the timeline shows each unit gathered forward and backward, and
   the next unit's forward gather handed over before the current unit's compute began.
2b. A subclassed model that calls its layers in the reverse of the order it made them (as
   examples/gpt.py calls its head last): equal to DistributedOptimizer; the call order is learnt,
   each unit is gathered once per phase per step (no prefetch of a unit that already ran) and
   the forward gathers after the first are prefetched in call order.
3. model.fit (Adam, 6 steps) equals DistributedOptimizer's model.fit; then model.save writes DIR/model.keras
   (whole weights and whole Adam state: every rank calls save; rank 0's path is the real one)
   and DIR/state.npz (what it must hold, gathered by hand).
4. With LOAD_FROM: its model.keras loads into a fully sharded model here (re-cut for this rank
   count) and into a plain model + plain Adam; both hold LOAD_FROM/state.npz.
At -np 2 and 3 (-np 4, the slowest launch on 2 cores, skips these two):
3b. A model with BatchNormalization and Dropout (seeded) trains as DistributedOptimizer's: the
   recompute in backward uses the forward's dropout mask and statistics.
5. Bad input, on every rank: a different model on the last rank (MismatchError), wrapping twice
   (ValueError), Adafactor (TypeError), a model that was not fully sharded (ValueError),
   DistributedGradientTape's gradients: MismatchError from the tape itself where a weight's
   pieces differ in size across the ranks, ValueError from ShardedOptimizer where every weight
   divides by p (both, at -np 2 and 3).
   Ranks that initialised the model apart get rank 0's weights (``sync_weights``); a Sequential
   built layer by layer inside ``fully_shard(input_shape=)`` holds the weights a built one does.
6. At -np 4, over ``Mesh(tensor=2).data_set``: each data group of 2 ranks shards over itself, equals
   DistributedOptimizer(process_set=data_set) there; the two tensor ranks' groups differ.
7. At -np 4, with tensor parallelism: a ColumnParallelDense -> RowParallelDense -> Dense model on
   Mesh(tensor=2), fully sharded over its data axis (each unit gathers its tensor slice over the
   data group, recomputes it, tensor collectives included, in backward), 4 Adam steps in a
   tf.function equal DistributedOptimizer over the data set on the same split model; each rank
   holds half of its tensor slice's weights.
Prints "rank R: stage3_check OK" at the end.
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import tfops.keras as hvd  # noqa: E402
from tfops.errors import MismatchError  # noqa: E402
from tfops.sharding.fully_shard import fully_shard, gathered_weights, state_of  # noqa: E402
from tfops.sharding.params import Status  # noqa: E402
from tfops.sharding.stage3 import FullyShardedOptimizer  # noqa: E402

hvd.init()
p, me = hvd.size(), hvd.rank()
OUT = sys.argv[1]
LOAD_FROM = sys.argv[2] if len(sys.argv) > 2 else None
K = keras.optimizers
T0 = time.perf_counter()


def took() -> str:
    return f"({time.perf_counter() - T0:.0f} s)"


def model(widths=(5, 4, 3), seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(widths[0], activation="tanh"),
                             keras.layers.Dense(widths[1], activation="tanh"), keras.layers.Dense(widths[2])])


def batches(n, seed):
    rng = np.random.default_rng(seed + me)
    return [(rng.standard_normal((4, 6)).astype("f4"), rng.standard_normal((4, 3)).astype("f4")) for _ in range(n)]


def train(opt, m, graph, steps=4):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return grads
    step = tf.function(step) if graph else step
    for x, y in batches(steps, 100):
        grads = step(x, y)
    return grads


def flat(weights) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in weights])


def same_everywhere(a: np.ndarray, what: str) -> None:
    everyone = hvd.allgather_object(a.tobytes())
    bad = [r for r, b in enumerate(everyone) if b != everyone[0]]
    assert not bad, f"rank {me}: {what}: ranks {bad} differ bitwise from rank 0"


def raises_everywhere(kind, fn, what: str) -> str:
    try:
        fn()
    except kind as e:
        return str(e)
    raise AssertionError(f"rank {me}: {what}: no {kind}")


N = sum(int(np.prod(v.shape)) for v in model().trainable_variables)

# 1 and 2. equal to DistributedOptimizer; every array a piece ----------------------------
for name, make, graph in [("Adam", lambda: K.Adam(0.02), True),
                          ("SGD nesterov", lambda: K.SGD(0.1, momentum=0.9, nesterov=True), False)]:
    ref, ref_opt = model(), hvd.DistributedOptimizer(make())
    train(ref_opt, ref, graph)
    m = fully_shard(model())
    opt = FullyShardedOptimizer(make())
    grads = train(opt, m, graph)
    got, want = flat(gathered_weights(m)), flat(ref.get_weights())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: {name}")
    assert np.abs(got - flat(model().get_weights())).max() > 1e-3, f"rank {me}: {name}: the weights did not move"
    same_everywhere(got, name)
    pieces = [int(np.prod(v.shape)) for v in m.trainable_variables]
    counts = hvd.allgather_object(sum(pieces))
    assert sum(counts) == N and max(counts) - min(counts) <= 1, f"rank {me}: pieces per rank {counts}, N = {N}"
    assert [tuple(g.shape) for g in grads] == [tuple(v.shape) for v in m.trainable_variables], \
        f"rank {me}: gradients {[g.shape for g in grads]}"
    slots = opt.inner_optimizer.variables[2:]
    if name == "Adam":
        assert sum(int(np.prod(s.shape)) for s in slots) == 2 * sum(pieces), f"rank {me}: Adam slots {len(slots)}"
        store = {}
        opt.save_own_variables(store)
        for k, w in enumerate(ref_opt.inner_optimizer.variables[2:]):
            np.testing.assert_allclose(store[str(2 + k)], w.numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=f"rank {me}: Adam slot {k}")
    fs = state_of(m)
    assert all(fs.status(u.index) is Status.NOT_AVAILABLE for u in fs.units), f"rank {me}: status after a step"
    last = [e for e in fs.exchange.timeline[-5 * len(fs.units):]]
    for u in fs.units:
        for phase in ("forward", "backward"):
            assert any(e["what"] == "gather" and e["unit"] == u.index and e["phase"] == phase for e in last), \
                f"rank {me}: unit {u.name} not gathered for {phase}: {last}"
    fwd = {e["unit"]: e for e in last if e["what"] == "forward"}
    for u in fs.units[1:]:
        g = next(e for e in last if e["what"] == "gather" and e["unit"] == u.index and e["phase"] == "forward")
        assert g["queued"] < fwd[u.index - 1]["start"], f"rank {me}: {u.name}'s gather was not prefetched: {last}"
    print(f"rank {me}: {name} {'tf.function' if graph else 'eager'}: max |stage 3 - DistributedOptimizer| = "
          f"{np.abs(got - want).max():.2e}; this rank holds {sum(pieces)} of {N} elements {took()}", flush=True)
    if name == "Adam":                                     # the same with every layer recomputed (keras.RematScope)
        with keras.RematScope(mode="full"):
            m = fully_shard(model())
        train(FullyShardedOptimizer(make()), m, graph)
        remat = flat(gathered_weights(m))
        np.testing.assert_allclose(remat, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: Adam, RematScope")
        same_everywhere(remat, "Adam, RematScope")
        print(f"rank {me}: Adam tf.function, RematScope(mode='full'): max |stage 3 - DistributedOptimizer| = "
              f"{np.abs(remat - want).max():.2e}, |recompute - without| = {np.abs(remat - got).max():.2e} {took()}",
              flush=True)

# 2b. a model that calls its layers in another order than it made them (examples/gpt.py makes its
# head second): the prefetch follows the calls, and no unit is gathered twice in a phase ---------
class Reversed(keras.Model):
    def __init__(self):
        super().__init__()
        self.c, self.b, self.a = keras.layers.Dense(3), keras.layers.Dense(4, activation="tanh"), \
            keras.layers.Dense(5, activation="tanh")

    def call(self, x):
        return self.c(self.b(self.a(x)))


ref = model()
train(hvd.DistributedOptimizer(K.Adam(0.02)), ref, True)
m = Reversed()
m(np.zeros((1, 6), "f4"))
start = model().get_weights()                              # a, b, c's kernel and bias; m holds c, b, a
m.set_weights(start[4:] + start[2:4] + start[:2])
fs = state_of(fully_shard(m))
train(FullyShardedOptimizer(K.Adam(0.02)), m, True)
w = gathered_weights(m)
got = flat(w[4:] + w[2:4] + w[:2])
np.testing.assert_allclose(got, flat(ref.get_weights()), rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: Reversed")
assert fs.order == (2, 1, 0), f"rank {me}: call order learnt {fs.order}, want (2, 1, 0) (a, b, c)"
gathers = [(e["unit"], e["phase"]) for e in fs.exchange.timeline if e["what"] == "gather"]
assert sorted(gathers) == sorted([(u, ph) for u in range(3) for ph in ("forward", "backward")] * 4), \
    f"rank {me}: 4 steps gather each unit once a phase a step; got {gathers}"
last = fs.exchange.timeline[-5 * len(fs.units):]
fwd = {e["unit"]: e for e in last if e["what"] == "forward"}
for before, u in ((2, 1), (1, 0)):                         # a, then b, then c
    g = next(e for e in last if e["what"] == "gather" and e["unit"] == u and e["phase"] == "forward")
    assert g["queued"] < fwd[before]["start"], f"rank {me}: unit {u}'s gather was not prefetched: {last}"
print(f"rank {me}: layers called in another order than made: equal, prefetched in call order {took()}", flush=True)

# 3. model.fit, then a whole checkpoint ----------------------------------------------------
x = np.concatenate([b[0] for b in batches(6, 7)])
y = np.concatenate([b[1] for b in batches(6, 7)])
ref = model()
ref.compile(optimizer=hvd.DistributedOptimizer(K.Adam(0.01)), loss="mse", jit_compile=False)
ref.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
m = fully_shard(model())
opt = FullyShardedOptimizer(K.Adam(0.01))
m.compile(optimizer=opt, loss="mse", jit_compile=False)
m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
got = flat(gathered_weights(m))
np.testing.assert_allclose(got, flat(ref.get_weights()), rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: model.fit")
same_everywhere(got, "model.fit")
where = OUT if me == 0 else os.path.join(OUT, f"rank{me}")
os.makedirs(where, exist_ok=True)
m.save(os.path.join(where, "model.keras"))
store, whole = {}, gathered_weights(m)                 # collectives: every rank
opt.save_own_variables(store)
if me == 0:
    np.savez(os.path.join(OUT, "state.npz"), *whole, *[store[str(i)] for i in range(len(store))])
print(f"rank {me}: model.fit equals DistributedOptimizer's; model.save at -np {p} {took()}", flush=True)

# 4. the files of another rank count --------------------------------------------------------
if LOAD_FROM:
    saved = np.load(os.path.join(LOAD_FROM, "state.npz"))
    want = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    for kind in ("fully sharded", "plain"):
        m2 = model()
        o2 = FullyShardedOptimizer(K.Adam(0.01)) if kind == "fully sharded" else K.Adam(0.01)
        if kind == "fully sharded":
            fully_shard(m2)
        m2.compile(optimizer=o2, loss="mse", jit_compile=False)
        o2.build(m2.trainable_variables)
        m2.load_weights(os.path.join(LOAD_FROM, "model.keras"))
        weights = gathered_weights(m2)
        store = {}
        (o2.save_own_variables if kind == "fully sharded" else K.Optimizer.save_own_variables.__get__(o2))(store)
        got = weights + [store[str(i)] for i in range(len(store))]
        assert len(got) == len(want), f"rank {me}: {kind}: {len(got)} arrays, saved {len(want)}"
        for k, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"rank {me}: {kind}: array {k}")
    print(f"rank {me}: loaded the files of another rank count (fully sharded and plain) {took()}", flush=True)

# 3b and 5, at -np 2 and 3 (-np 4, the slowest launch on 2 cores, skips them): layers with state, then bad input
if p < 4:
    # 3b. BatchNormalization's statistics and a Dropout mask that backward's recompute must repeat
    def stateful():
        keras.utils.set_random_seed(2)
        # no bias before BatchNormalization: its gradient is zero up to rounding, which Adam would amplify to
        # +-lr steps that differ with the summation order (seen at -np 3, 1.4e-4 on values of 1e-3)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, use_bias=False),
                                 keras.layers.BatchNormalization(), keras.layers.Dropout(0.5, seed=1),
                                 keras.layers.Dense(3)])

    results = []
    for m in (stateful(), fully_shard(stateful())):
        opt = FullyShardedOptimizer(K.Adam(0.01)) if state_of(m) else hvd.DistributedOptimizer(K.Adam(0.01))
        m.compile(optimizer=opt, loss="mse", jit_compile=False)
        m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        results.append(flat(gathered_weights(m)))          # whole weights, then this rank's BatchNorm statistics
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: BatchNorm + Dropout")
    print(f"rank {me}: BatchNormalization + Dropout: model.fit equals DistributedOptimizer's {took()}", flush=True)

    # 5. bad input, on every rank
    msg = raises_everywhere(MismatchError, lambda: fully_shard(model((5, 4, 3) if me < p - 1 else (4, 5, 3))),
                            "a different model")
    assert f"rank {p - 1}" in msg, msg
    twice = fully_shard(model())
    msg = raises_everywhere(ValueError, lambda: fully_shard(twice), "wrapping twice")
    assert "already fully sharded" in msg, msg
    msg = raises_everywhere(TypeError, lambda: FullyShardedOptimizer(K.Adafactor()), "Adafactor")
    assert "Adafactor" in msg, msg
    plain = model()
    msg = raises_everywhere(ValueError, lambda: FullyShardedOptimizer(K.Adam()).build(plain.trainable_variables),
                            "a plain model")
    assert "fully_shard" in msg, msg

    def tape_step(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(np.ones((2, 6), "f4")))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, m.trainable_variables)
        FullyShardedOptimizer(K.Adam()).apply(grads, m.trainable_variables)

    # DistributedGradientTape's gradients: a weight whose pieces differ in size across the ranks fails in
    # the tape's own allreduce; where every weight divides by p (widths 6: 2 and 3 divide every size),
    # ShardedOptimizer refuses them
    for widths in ((5, 4, 3), (6, 6, 6)):
        m = twice if widths == (5, 4, 3) else fully_shard(model(widths))
        even = all(int(np.prod(v.shape)) % p == 0 for v in model(widths).trainable_variables)
        msg = raises_everywhere((ValueError, MismatchError), lambda: tape_step(m), f"DistributedGradientTape {widths}")
        want = "DistributedGradientTape" if even else "differs across ranks"
        assert want in msg, f"rank {me}: widths {widths} at -np {p}: wanted {want!r} in: {msg}"
    print(f"rank {me}: bad input raises on every rank {took()}", flush=True)
    keras.utils.set_random_seed(3)                          # a Sequential built layer by layer, cut as it goes
    lazy = fully_shard(keras.Sequential([keras.layers.Dense(w, activation=a)
                                         for w, a in ((5, "tanh"), (4, "tanh"), (3, None))]), input_shape=(None, 6))
    np.testing.assert_array_equal(flat(gathered_weights(lazy)), flat(model().get_weights()), err_msg=f"rank {me}: lazy")
    apart = fully_shard(model(seed=3 + me))                 # initialised apart: the pieces are cut from rank 0's
    np.testing.assert_array_equal(flat(gathered_weights(apart)), flat(model().get_weights()), err_msg=f"rank {me}: sync")

# 6. over a mesh's data axis (-np 4: tensor 2 x data 2; each data group of 2 is its own world) ----
if p == 4:
    from tfops.parallel import Mesh
    mesh = Mesh(tensor=2)
    ref = model()
    train(hvd.DistributedOptimizer(K.Adam(0.02), process_set=mesh.data_set), ref, True)
    m = fully_shard(model(), process_set=mesh.data_set)
    train(FullyShardedOptimizer(K.Adam(0.02)), m, True)
    got = flat(gathered_weights(m))
    np.testing.assert_allclose(got, flat(ref.get_weights()), rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: data_set")
    everyone = hvd.allgather_object(got.tobytes())
    partner = mesh.rank_of(tensor_rank=mesh.tensor_rank, data_rank=1 - mesh.data_rank)
    other = mesh.rank_of(tensor_rank=1 - mesh.tensor_rank)
    assert everyone[partner] == everyone[me] and everyone[other] != everyone[me], f"rank {me}: data groups"
    assert sum(int(np.prod(v.shape)) for v in m.trainable_variables) in (N // 2, N - N // 2)
    print(f"rank {me}: fully_shard over mesh.data_set (data rank {mesh.data_rank}): equal to DistributedOptimizer "
          f"over the set, 1/2 of the weights {took()}", flush=True)

# 7. with tensor parallelism (-np 4): the split layers' slices fully sharded over the data axis ------
if p == 4:
    from tfops.parallel import ColumnParallelDense, RowParallelDense

    def split_model():
        keras.utils.set_random_seed(5)                   # init="sliced": each tensor rank its slice of one draw
        return keras.Sequential([keras.Input((6,)), ColumnParallelDense(8, mesh, activation="tanh"),
                                 RowParallelDense(6, mesh), keras.layers.Dense(3)])

    def split_train(opt, m):
        rng = np.random.default_rng(200 + mesh.data_rank)            # a tensor group sees one batch

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((m(x, training=True) - y) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
        for _ in range(4):
            step(tf.constant(rng.standard_normal((4, 6)), tf.float32), tf.constant(rng.standard_normal((4, 3)), tf.float32))

    ref = split_model()
    split_train(hvd.DistributedOptimizer(K.Adam(0.02), process_set=mesh.data_set), ref)
    m = fully_shard(split_model(), process_set=mesh.data_set)
    split_train(FullyShardedOptimizer(K.Adam(0.02)), m)
    got, want = flat(gathered_weights(m)), flat(ref.get_weights())  # this tensor rank's slices, whole
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {me}: tensor 2 x fully sharded data 2")
    everyone = hvd.allgather_object(got.tobytes())
    assert everyone[mesh.rank_of(tensor_rank=mesh.tensor_rank, data_rank=1 - mesh.data_rank)] == everyone[me], \
        f"rank {me}: the data group's two ranks hold different slices"
    n_split = int(want.size)
    assert sum(int(np.prod(v.shape)) for v in m.trainable_variables) in (n_split // 2, n_split - n_split // 2)
    print(f"rank {me}: ColumnParallelDense + RowParallelDense at tensor 2, fully sharded over data 2: equal to "
          f"DistributedOptimizer over the data set, max diff {np.abs(got - want).max():.1e}, 1/2 of the "
          f"tensor slice's weights {took()}", flush=True)
print(f"rank {me}: stage3_check OK", flush=True)
