"""Rank script: alltoall, reducescatter, grouped_allgather/_reducescatter and process sets in tfops.

Run by tests/test_tf_rank_scripts.py (through tf_in_turn.py) as ``python tf_collectives.py`` and under
``mpirun -np 2`` and ``-np 3``. Every rank can build every rank's inputs,
so each result is checked against a numpy reference, and each gradient
against its closed form for the loss L = sum_k W[k] * sum(y_k) (rank k weights
its output by W[k] = k + 1), eager and inside tf.function; a model.fit
checks an alltoall round trip's gradient routing. Also: ranks whose dtypes
differ fail on every rank and the automatic names stay in step; reducescatter's
scale factors against Horovod 0.28.1's expected values (float16, integers),
and broadcast_ in place in a TF1 graph (ref and resource variables). Prints
"tf_collectives OK".
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import allreduce as ar  # noqa: E402
import tfops  # noqa: E402
from allreduce.errors import InvalidArgumentError, MismatchError  # noqa: E402

evens_given = tfops.ProcessSet([r for r in range(int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) if r % 2 == 0])
tfops.init(process_sets=[evens_given])          # Horovod's static sets, registered at init
p, me = tfops.size(), tfops.rank()
W = np.arange(1, p + 1, dtype=np.float64)
rng = np.random.default_rng(7)
SPLITS = rng.integers(0, 4, (p, p))             # SPLITS[r, j]: rows rank r sends rank j (zeros likely)
SPLITS[0, :] = 0                                # rank 0 sends nothing at all
ROWS = [np.arange(int(SPLITS[r].sum()) * 2, dtype=np.float32).reshape(-1, 2) + 100 * r for r in range(p)]


def everyone_raised(kind, fn, needle: str) -> None:
    """fn() raises ``kind`` (or a tf.errors.OpError naming it) with ``needle``; every rank agrees."""
    try:
        fn()
        raised = "no error"
    except kind as exc:
        raised = "ok" if needle in str(exc) else f"message without {needle!r}: {exc}"
    except tf.errors.OpError as exc:
        raised = "ok" if needle in str(exc) else f"{type(exc).__name__}: {exc}"
    flags = tfops.allgather_object(raised)
    assert flags == ["ok"] * p, f"{kind.__name__} not raised as expected on every rank: {flags}"


def grads_of(fn, x, eager: bool):
    """(y, dL/dx) for L = W[me] * sum(first output of fn(x))."""
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            first = y[0] if isinstance(y, (tuple, list)) else y
            loss = tf.reduce_sum(first) * W[me]
        return y, tape.gradient(loss, x)
    return run(x) if eager else tf.function(run)(x)


def received_by(r: int) -> np.ndarray:
    """What rank r must receive: rank j's block r, for every j."""
    return np.concatenate([ROWS[j][SPLITS[j, :r].sum():SPLITS[j, :r + 1].sum()] for j in range(p)])


def share(n: int, r: int) -> slice:
    """Rank r's rows of n under Horovod's split (the first n % p ranks get one more)."""
    sizes = [n // p + (1 if k < n % p else 0) for k in range(p)]
    return slice(sum(sizes[:r]), sum(sizes[:r + 1]))


# ---------------------------------------------------------------- the core
out, rs = ar.alltoall(ROWS[me], SPLITS[me])
np.testing.assert_array_equal(out, received_by(me))
assert rs.tolist() == SPLITS[:, me].tolist()

for eager in (True, False):
    mode = "eager" if eager else "tf.function"
    # alltoall, uneven splits with zeros: rows, received splits, gradient (rows sent to j get W[j]).
    (y, rsplits), g = grads_of(lambda t: tfops.alltoall(t, splits=SPLITS[me]), tf.constant(ROWS[me]), eager)
    np.testing.assert_array_equal(y.numpy(), received_by(me), err_msg=mode)
    assert rsplits.dtype == tf.int32 and rsplits.numpy().tolist() == SPLITS[:, me].tolist(), mode
    want = np.concatenate([np.full((SPLITS[me, j], 2), W[j]) for j in range(p)])
    np.testing.assert_array_equal(g.numpy(), want.reshape(-1, 2), err_msg=mode)
    # alltoall without splits: equal shares, the tensor alone; integers and zero rows too.
    eq = np.arange(2 * p * 3, dtype=np.int64).reshape(2 * p, 3) + 1000 * me
    y = tfops.alltoall(tf.constant(eq))
    np.testing.assert_array_equal(y.numpy(), np.concatenate([(np.arange(2 * p * 3).reshape(2 * p, 3) + 1000 * j)
                                                             [2 * me:2 * me + 2] for j in range(p)]))
    y, rsplits = tfops.alltoall(tf.zeros([0, 4]), splits=[0] * p)
    assert y.shape == (0, 4) and rsplits.numpy().tolist() == [0] * p

    # reducescatter, dim 0 not divisible by p, Sum and Average, with scale factors.
    n = 2 * p + 1
    xs = [np.arange(n * 3, dtype=np.float64).reshape(n, 3) * (r + 1) for r in range(p)]
    for op, pre, post in ((tfops.Sum, 1.0, 1.0), (tfops.Average, 2.0, 0.5), (tfops.Sum, 3.0, 1.0)):
        y, g = grads_of(lambda t: tfops.reducescatter(t, op=op, prescale_factor=pre, postscale_factor=post),
                        tf.constant(xs[me]), eager)
        ref = sum(xs) * pre * post / (p if op == tfops.Average else 1)
        np.testing.assert_allclose(y.numpy(), ref[share(n, me)], rtol=1e-12, err_msg=f"{mode} {op}")
        factor = pre * post * (p if op == tfops.Sum else 1)   # Horovod's: Sum's gradient times size
        want = np.concatenate([np.full((share(n, k).stop - share(n, k).start, 3), W[k]) for k in range(p)])
        np.testing.assert_allclose(g.numpy(), want * factor, rtol=1e-12, err_msg=f"{mode} {op} grad")

    # grouped_reducescatter and grouped_allgather (rows differ by rank; rank 0 has none).
    a, b = tfops.grouped_reducescatter([tf.constant(xs[me]), tf.constant(xs[me][:p])], op=tfops.Sum)
    np.testing.assert_allclose(a.numpy(), sum(xs)[share(n, me)])
    np.testing.assert_allclose(b.numpy(), sum(xs)[:p][share(p, me)])
    gx = tf.constant(np.full((me, 2), me + 0.5))

    def gathered(t):
        u, v = tfops.grouped_allgather([t, 2.0 * t[:, :1]])
        return tf.concat([tf.reshape(u, [-1]), tf.reshape(v, [-1])], 0)
    y, g = grads_of(gathered, gx, eager)
    want = np.concatenate([np.full(2 * r, r + 0.5) for r in range(p)] + [np.full(r, 2 * r + 1.0) for r in range(p)])
    np.testing.assert_allclose(y.numpy(), want, err_msg=mode)
    np.testing.assert_allclose(g.numpy(), np.tile([[3 * W.mean(), W.mean()]], (me, 1)), err_msg=mode)

# ---------------------------------------------------------------- Horovod's scale arithmetic
# reducescatter and grouped_reducescatter with prescale/postscale as Horovod 0.28.1's own tests expect them
# (test_horovod_reducescatter_cpu_prescale/_postscale): the same tensor on every rank, float16 scaled in
# float32 and integers in float64, then cast back (truncation); the results must be equal, not close.
COMPUTE = {np.float16: np.float32, np.int32: np.float64, np.int64: np.float64, np.float32: np.float32}
for dtype, compute in COMPUTE.items():
    x = np.random.default_rng(12345).uniform(-100, 100, (p * 4, 3)).astype(dtype)
    factor = 0.37                                   # not a float16 value: scaled in float16, results differ
    rows = slice(me * 4, me * 4 + 4)
    pre_want = (compute(factor) * x.astype(compute)).astype(dtype)[rows] * dtype(p)
    post_want = (compute(factor) * (x * dtype(p)).astype(compute)).astype(dtype)[rows]
    for name, fn in (("reducescatter", lambda t, **k: tfops.reducescatter(t, op=tfops.Sum, **k)),
                     ("grouped_reducescatter", lambda t, **k: tfops.grouped_reducescatter([t, t], op=tfops.Sum,
                                                                                          **k)[1])):
        got = fn(tf.constant(x), prescale_factor=factor).numpy()
        assert got.dtype == dtype and np.array_equal(got, pre_want), (name, "prescale", dtype, got - pre_want)
        got = fn(tf.constant(x), postscale_factor=factor).numpy()
        assert np.array_equal(got, post_want), (name, "postscale", dtype, got - post_want)

# ---------------------------------------------------------------- broadcast_ in a TF1 graph
# Horovod's test_horovod_broadcast_inplace_cpu, graph half: ref and resource variables in a tf.compat.v1
# Session; the returned tensor holds root's values, and the variable, read in a later run, holds them too.
from tensorflow.python.ops.ref_variable import RefVariable  # noqa: E402
from tensorflow.python.ops.resource_variable_ops import ResourceVariable  # noqa: E402

for make in (RefVariable, ResourceVariable):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        var = make(tf.constant(np.full((3, 2), me, np.float32)))
        flags = make(tf.constant(np.arange(3) % 2 == me % 2))
        sess.run(tf.compat.v1.global_variables_initializer())
        root = p - 1
        out, out_flags = tfops.broadcast_([var, flags], root)
        assert out.dtype == tf.float32 and out_flags.dtype == tf.bool, (out, out_flags)
        np.testing.assert_array_equal(sess.run(out), np.full((3, 2), root, np.float32), err_msg=make.__name__)
        np.testing.assert_array_equal(sess.run(var), np.full((3, 2), root, np.float32), err_msg=make.__name__)
        np.testing.assert_array_equal(sess.run(out_flags), np.arange(3) % 2 == root % 2)
        np.testing.assert_array_equal(sess.run(flags), np.arange(3) % 2 == root % 2)

# ---------------------------------------------------------------- errors, raised on every rank
bad = [1] * (p + 1) if p == 1 else [2] + [0] * (p - 1)       # too long on 1 rank; else sums to 2 != 3 rows
everyone_raised(InvalidArgumentError, lambda: tfops.alltoall(tf.zeros([3, 2]), splits=bad if me == p - 1 else
                                                             [3] + [0] * (p - 1)), f"alltoall on rank {p - 1}")
everyone_raised(InvalidArgumentError, lambda: tf.function(lambda t: tfops.alltoall(t, splits=[-1] + [1] * (p - 1)
                                                          if me == 0 else [p - 1] + [0] * (p - 1)))(
                                                              tf.zeros([p - 1, 2])), "splits[0] is negative")
# Eagerly it is also TensorFlow's InvalidArgumentError (Horovod's type), not only the core's ValueError.
everyone_raised(tf.errors.InvalidArgumentError, lambda: tfops.alltoall(tf.zeros([3, 2]), splits=bad), "splits")
if p > 1:
    everyone_raised(InvalidArgumentError, lambda: tfops.alltoall(tf.zeros([p + me % 2, 2])), "divisible")
    everyone_raised(MismatchError, lambda: tfops.reducescatter(tf.zeros([2 + me])), "differs")
    # as many elements, another rank (Horovod's test_horovod_reducescatter_error): the core sees equal counts
    everyone_raised(MismatchError, lambda: tfops.reducescatter(tf.zeros([2, 6] if me == 0 else [2, 2, 3])),
                    "shape differs between ranks (rank 0: [(2, 6)]; rank 1: [(2, 2, 3)]")
everyone_raised(NotImplementedError, lambda: tfops.reducescatter(tf.zeros([2]), op=tfops.Max), "tfops.Sum and tfops.Average")
np.testing.assert_allclose(tfops.allreduce(tf.ones(2), op=tfops.Sum).numpy(), [p, p])   # still in step
if p > 1:
    # A dtype that differs by rank fails on every rank, and takes one automatic name on every rank all
    # the same: an integer broadcast or allgather used to take none where a float one took one, so the
    # next auto-named ops waited for names no other rank used (Horovod's test_horovod_broadcast_type_error,
    # eager and graph, then test_horovod_grouped_allreduce_*: StallError 'out of step', issue 41)
    mixed = tf.ones([3], tf.int32 if me % 2 == 0 else tf.float32)

    @tf.function
    def broadcast_mixed():
        return tfops.broadcast(mixed, 0)
    everyone_raised(MismatchError, lambda: tfops.broadcast(mixed, 0), "ranks disagree")
    everyone_raised(MismatchError, broadcast_mixed, "ranks disagree")
    everyone_raised(MismatchError, lambda: tfops.allgather(mixed), "dtype differs")
    np.testing.assert_allclose(tfops.grouped_allreduce([tf.ones(2)], op=tfops.Sum)[0].numpy(), [p, p])
    np.testing.assert_allclose(tfops.broadcast(tf.fill([2], float(me)), 0).numpy(), [0, 0])

# ---------------------------------------------------------------- process sets
evens, odds = evens_given, tfops.add_process_set([r for r in range(p) if r % 2])
mine = evens if me % 2 == 0 else odds
members = mine.ranks
assert mine.included() and mine.size() == len(members) and mine.rank() == members.index(me)
assert evens.size() == (p + 1) // 2 and tfops.global_process_set.ranks == list(range(p))
assert int(tfops.process_set_included_op(evens.process_set_id)) == int(me % 2 == 0)
# a process set's allreduce scales as the global one does: float16 in float32, integers in float64
for dtype, compute in COMPUTE.items():
    x = np.random.default_rng(7).uniform(-100, 100, 12).astype(dtype)     # the same on every member
    k = len(members)
    pre_want = (compute(0.37) * x.astype(compute)).astype(dtype) * dtype(k)
    got = tfops.allreduce(tf.constant(x), op=tfops.Sum, prescale_factor=0.37, process_set=mine).numpy()
    assert got.dtype == dtype and np.array_equal(got, pre_want), ("process set prescale", dtype, got - pre_want)
    post_want = (compute(0.37) * (x * dtype(k)).astype(compute)).astype(dtype)
    got = tfops.allreduce(tf.constant(x), op=tfops.Sum, postscale_factor=0.37, process_set=mine).numpy()
    assert np.array_equal(got, post_want), ("process set postscale", dtype, got - post_want)
for eager in (True, False):
    mode = "eager" if eager else "tf.function"
    x = tf.constant(np.arange(6, dtype=np.float64).reshape(3, 2) + me)
    y, g = grads_of(lambda t: tfops.allreduce(t, op=tfops.Sum, process_set=mine), x, eager)
    np.testing.assert_allclose(y.numpy(), sum(np.arange(6).reshape(3, 2) + r for r in members), err_msg=mode)
    np.testing.assert_allclose(g.numpy(), np.full((3, 2), sum(W[r] for r in members)), err_msg=mode)
    y, g = grads_of(lambda t: tfops.allreduce(t, average=True, process_set=mine), x, eager)
    np.testing.assert_allclose(y.numpy(), np.mean([np.arange(6).reshape(3, 2) + r for r in members], 0))
    ys = tfops.grouped_allreduce([x, tf.constant([me])], op=tfops.Sum, process_set=mine)
    assert ys[1].numpy().tolist() == [sum(members)], mode
    y, g = grads_of(lambda t: tfops.allgather(t, process_set=mine), tf.constant([[float(me)]] * (me + 1)), eager)
    np.testing.assert_array_equal(y.numpy().ravel(), np.concatenate([[r] * (r + 1) for r in members]))
    np.testing.assert_allclose(g.numpy(), np.full((me + 1, 1), np.mean([W[r] for r in members])), err_msg=mode)
    root = members[-1]
    y, g = grads_of(lambda t: tfops.broadcast(t, root, process_set=mine), x, eager)
    np.testing.assert_array_equal(y.numpy(), np.arange(6).reshape(3, 2) + root)
    np.testing.assert_allclose(g.numpy(), np.full((3, 2), np.mean([W[r] for r in members]) if me == root else 0))
    y, rsplits = tfops.alltoall(tf.constant([[float(me)]] * len(members)), splits=[1] * len(members),
                                process_set=mine)
    assert y.numpy().ravel().tolist() == [float(r) for r in members] and rsplits.numpy().tolist() == [1] * len(members)
    y = tfops.reducescatter(tf.ones([len(members), 2]), op=tfops.Sum, process_set=mine)
    np.testing.assert_array_equal(y.numpy(), np.full((1, 2), len(members)))
# grouped_allreduce on a set is fused as the world's is: consecutive float tensors of one dtype in
# one allreduce (an integer tensor or a dtype change starts another); values and gradients as one by one


def group_of(r: int) -> list:
    return [np.arange(4.0, dtype=np.float32).reshape(2, 2) * (r + 1), np.array([r], np.float32),
            np.array([r, 1], np.int32), np.array([2 * r, 3, 1], np.float32), np.array([[1.0 + r]], np.float64)]


calls = []
comm = mine.communicator
inner_allreduce = comm.allreduce
comm.allreduce = lambda a, *args, **kw: calls.append(a.size) or inner_allreduce(a, *args, **kw)
try:
    for eager in (True, False):
        calls.clear()
        parts = [tf.constant(v) for v in group_of(me)]
        run = (lambda f: f()) if eager else (lambda f: tf.function(f)())
        ys = run(lambda: tfops.grouped_allreduce(parts, op=tfops.Sum, process_set=mine))
        assert sorted(calls) == [1, 2, 3, 5], ("grouped_allreduce on a set: one allreduce per run of a float dtype",
                                               eager, calls)
        for got, want in zip(ys, [sum(vs) for vs in zip(*[group_of(r) for r in members])]):
            assert got.dtype == want.dtype and np.array_equal(got.numpy(), want), ("fused on a set", eager, got, want)
    xs = [tf.constant(np.ones((2, 3)) * (me + 1)), tf.constant(np.ones(4))]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        ys = tfops.grouped_allreduce(xs, op=tfops.Sum, process_set=mine)
        loss = tf.reduce_sum(ys[0] * 2.0) + tf.reduce_sum(ys[1] * 3.0)
    gs = tape.gradient(loss, xs)
    np.testing.assert_allclose(gs[0].numpy(), np.full((2, 3), 2.0 * len(members)))
    np.testing.assert_allclose(gs[1].numpy(), np.full(4, 3.0 * len(members)))
finally:
    comm.allreduce = inner_allreduce
# the object collectives on a set (Horovod 0.28's process_set=): root_rank is a world rank in the set
assert tfops.allgather_object({"r": me}, process_set=mine) == [{"r": r} for r in members]
assert tfops.broadcast_object(me * 10 + 1, root_rank=members[-1], process_set=mine) == members[-1] * 10 + 1
assert tfops.broadcast_object_fn(root_rank=members[0], process_set=mine)(("x", me)) == ("x", members[0])
# DistributedGradientTape(process_set=): the members average; a rank outside keeps its own (Horovod's rule)
x = tf.constant(float(me))
with tf.GradientTape() as g:
    g.watch(x)
    y = x * x
got = float(tfops.DistributedGradientTape(g, process_set=evens).gradient(y, [x])[0])
want = 2.0 * sum(evens.ranks) / evens.size() if me % 2 == 0 else 2.0 * me
assert abs(got - want) < 1e-6, (me, got, want)
other = odds if me % 2 == 0 else evens
if other.size():                                   # a rank outside a set gets an error at once, alone
    for call in (lambda: tfops.allreduce(tf.ones(2), process_set=other),
                 lambda: tfops.alltoall(tf.ones([2, 1]), process_set=other)):
        try:
            call()
            raise AssertionError("a non-member's call did not raise")
        except tf.errors.InvalidArgumentError as exc:
            assert isinstance(exc, ValueError) and f"rank {me} is not in" in str(exc), exc
    try:
        other.rank()
        raise AssertionError("rank() outside the set did not raise")
    except ValueError:
        pass
if p > 1:
    everyone_raised(MismatchError, lambda: tfops.add_process_set([0] if me == 0 else list(range(p))), "differ")
everyone_raised(InvalidArgumentError, lambda: tfops.add_process_set([p] if me == p - 1 else [0]), f"rank {p - 1}")
everyone_raised(InvalidArgumentError, lambda: tfops.add_process_set(list(evens.ranks)), "already registered")
assert tfops.remove_process_set(odds) and not tfops.remove_process_set(tfops.global_process_set)
assert odds.size() is None and odds.process_set_id is None
try:
    tfops.allreduce(tf.ones(2), process_set=odds)
    raise AssertionError("a removed set still ran")
except ValueError as exc:
    assert "not registered" in str(exc) or "not in" in str(exc), exc

# ---------------------------------------------------------------- model.fit: an alltoall round trip
# Rows go out to every rank and come straight back: the identity, so the fit (each rank on its own
# data, no gradient sync) must match a plain model's, which proves the gradients route back.
class RoundTrip(keras.layers.Layer):
    def call(self, t):
        there = tfops.alltoall(t)
        return tfops.alltoall(there)


def fit(with_round_trip: bool) -> list:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,), batch_size=2 * p)
    h = keras.layers.Dense(4)(inputs)
    outputs = keras.layers.Dense(1)(RoundTrip()(h) if with_round_trip else h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    data = np.random.default_rng(me).standard_normal((8 * p, 3)).astype(np.float32)
    model.fit(data, data.sum(1, keepdims=True), batch_size=2 * p, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


for a, b in zip(fit(True), fit(False)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

tfops.shutdown()
print(f"rank {me}: tf_collectives OK", flush=True)
sys.exit(0)
