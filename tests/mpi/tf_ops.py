"""Rank script: tfops ops, their gradients and their errors, eager and inside tf.function.

Run by tests/test_tf_rank_scripts.py (through tf_in_turn.py) as ``python tf_ops.py`` (one process: ar.init() in
singleton MPI) and ``mpirun -np 3 python tf_ops.py``.

The gradients are checked against closed forms for the global loss
L = sum_k L_k, where rank k's loss weights its output by (k + 1):
every rank can compute every other rank's inputs and weights.
It then runs tests/mpi/tf_surface.py's checks (Horovod's surface, issue 27) on the same engine.
Prints "tf_ops OK" on every rank at the end.
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
from allreduce.errors import MismatchError, StallError  # noqa: E402

tfops.init()
p, me = tfops.size(), tfops.rank()
W = np.arange(1, p + 1, dtype=np.float64)          # rank k weights its loss by k + 1


def x_of(r: int, rows: int = 1) -> np.ndarray:
    return (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 10 * r) * (1 if r % 2 else -1)


def everyone_raised(kind, fn, needle: str) -> None:
    """fn() raises ``kind`` with ``needle`` in its message on this rank; every rank agrees it did.

    Inside a tf.function the engine's error reaches the caller as a tf.errors.OpError whose
    message names the engine's exception and repeats its text.
    """
    try:
        fn()
        raised = "no error"
    except kind as exc:
        raised = "ok" if needle in str(exc) else f"message without {needle!r}: {exc}"
    except tf.errors.OpError as exc:
        raised = "ok" if f"{kind.__name__}: " in str(exc) and needle in str(exc) else f"{type(exc)}: {exc}"
    flags = tfops.allgather_object(raised)
    assert flags == ["ok"] * p, f"{kind.__name__} not raised as expected on every rank: {flags}"


def grads_of(fn, x, eager: bool):
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y) * W[me]
        return y, tape.gradient(loss, x)
    return run(x) if eager else tf.function(run)(x)


for eager in (True, False):
    mode = "eager" if eager else "tf.function"
    x = tf.constant(x_of(me))
    xs = np.stack([x_of(r) for r in range(p)])

    # allreduce Sum / Average: the gradient is an allreduce with the same op.
    y, g = grads_of(lambda t: tfops.allreduce(t, op=tfops.Sum), x, eager)
    np.testing.assert_allclose(y.numpy(), xs.sum(0), rtol=1e-6, err_msg=mode)
    np.testing.assert_allclose(g.numpy(), np.full_like(x_of(0), W.sum()), rtol=1e-6, err_msg=mode)
    y, g = grads_of(lambda t: tfops.allreduce(t), x, eager)
    np.testing.assert_allclose(y.numpy(), xs.mean(0), rtol=1e-6, err_msg=mode)
    np.testing.assert_allclose(g.numpy(), np.full_like(x_of(0), W.mean()), rtol=1e-6, err_msg=mode)

    # Max: the summed upstream gradient goes to the rank holding the maximum.
    y, g = grads_of(lambda t: tfops.allreduce(t, op=tfops.Max), x, eager)
    np.testing.assert_array_equal(y.numpy(), xs.max(0))
    np.testing.assert_allclose(g.numpy(), np.where(x_of(me) == xs.max(0), W.sum(), 0.0), err_msg=mode)

    # grouped_allreduce: values and gradients of each tensor.
    def grouped(t):
        a, b = tfops.grouped_allreduce([t, 2.0 * t[:, :2]], op=tfops.Sum)
        return tf.concat([a, b], axis=1)
    y, g = grads_of(grouped, x, eager)
    np.testing.assert_allclose(y.numpy(), np.concatenate([xs.sum(0), 2 * xs.sum(0)[:, :2]], 1), rtol=1e-6)
    np.testing.assert_allclose(g.numpy(), W.sum() * np.array([[3.0, 3.0, 1.0]]), rtol=1e-6, err_msg=mode)

    # allgather with a different row count per rank: the gradient is this rank's rows of the mean
    # of every rank's upstream gradient (Horovod's).
    rows = me + 1
    xr = tf.constant(x_of(me, rows))
    y, g = grads_of(tfops.allgather, xr, eager)
    np.testing.assert_array_equal(y.numpy(), np.concatenate([x_of(r, r + 1) for r in range(p)]))
    np.testing.assert_allclose(g.numpy(), np.full((rows, 3), W.mean()), err_msg=mode)

    # broadcast: root's value everywhere; the gradient is the mean on the root, 0 elsewhere.
    root = p - 1
    y, g = grads_of(lambda t: tfops.broadcast(t, root_rank=root), x, eager)
    np.testing.assert_array_equal(y.numpy(), x_of(root))
    np.testing.assert_allclose(g.numpy(), np.full_like(x_of(0), W.mean() if me == root else 0.0), err_msg=mode)

    # Compression: fp16 on the wire, float32 out, within fp16 rounding.
    y = tfops.allreduce(x, op=tfops.Sum, compression=tfops.Compression.fp16, name=f"fp16.{mode}")
    assert y.dtype == tf.float32
    np.testing.assert_allclose(y.numpy(), xs.sum(0), rtol=2e-3, atol=1e-2)

# Sparse: IndexedSlices are allgathered (values and indices), Average divides the values.
sl = tf.IndexedSlices(tf.constant([[float(me + 1)] * 2]), tf.constant([me % 2]), tf.constant([2, 2]))
out = tfops.allreduce(sl, op=tfops.Average)
assert isinstance(out, tf.IndexedSlices)
np.testing.assert_array_equal(out.indices.numpy(), [r % 2 for r in range(p)])
np.testing.assert_allclose(tf.convert_to_tensor(out).numpy(),
                           sum(np.outer(np.eye(2)[r % 2], [r + 1.0] * 2) for r in range(p)) / p)

# Integer tensors reduce too (no gradient).
np.testing.assert_array_equal(tfops.allreduce(tf.constant([me, 1]), op=tfops.Sum).numpy(), [p * (p - 1) // 2, p])

# broadcast_variables: keras and tf variables, two dtypes, in one call; also inside tf.function.
kv = keras.Variable(np.full((2, 2), me, np.float32))
tv = tf.Variable(np.array([me, me + 1], np.int64))
tfops.broadcast_variables([kv, tv], root_rank=0)
np.testing.assert_array_equal(kv.numpy(), np.zeros((2, 2)))
np.testing.assert_array_equal(tv.numpy(), [0, 1])
kv.assign(np.full((2, 2), me, np.float32))

@tf.function
def broadcast_in_graph():
    tfops.broadcast_variables([kv], root_rank=p - 1)


broadcast_in_graph()
np.testing.assert_array_equal(kv.numpy(), np.full((2, 2), p - 1))

# Objects.
assert tfops.broadcast_object({"rank": me}, root_rank=0) == {"rank": 0}
assert tfops.allgather_object(me * 2) == [2 * r for r in range(p)]

# Errors. XLA cannot call back into Python: a clear error at trace time, on any size.
try:
    tf.function(lambda t: tfops.allreduce(t), jit_compile=True)(x)
    raise AssertionError("no error under XLA")
except tfops.XlaNotSupportedError as exc:
    assert "jit_compile=False" in str(exc)
try:
    tfops.allreduce(x, op="sum")
    raise AssertionError("op='sum' accepted")
except ValueError as exc:
    assert "Product" in str(exc) and "'sum'" in str(exc)

# GradientHooks: the average of every rank's gradients; on one rank the hooks stand aside (no
# submit at all) and hand back exactly the plain tape's gradients.
hook_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
hook_x = tf.constant(np.random.default_rng(me).random((4, 3), np.float32))
hooks = tfops.GradientHooks(hook_model)
with tf.GradientTape() as tape:
    with hooks.forward():
        hook_loss = tf.reduce_sum(hook_model(hook_x) ** 2)
raw = tape.gradient(hook_loss, hook_model.trainable_variables)
hooked = hooks.wait(raw)
with tf.GradientTape() as tape:
    plain_loss = tf.reduce_sum(hook_model(hook_x) ** 2)
plain = tape.gradient(plain_loss, hook_model.trainable_variables)
for h, r, g in zip(hooked, raw, plain):
    expect = g.numpy() if p == 1 else tfops.allreduce(g, op=tfops.Average).numpy()
    np.testing.assert_allclose(h.numpy(), expect, rtol=1e-5, atol=1e-6)
    if p == 1:
        assert h is r, "one rank: the hooks must return the tape's own gradients"
assert not hooks._handles, hooks._handles

# The eager fast path (tfops/collectives/eager.py: no numpy_function, results kept without a copy): one group
# of mixed dtypes and shapes (float32 1-D: one tf.split; float64 2-D and an int32 scalar: a tensor
# per array), 0 elements and a 1.2 MB array (the engine's pooled result memory), against float64
# numpy, bitwise equal on every rank; earlier results and the inputs unchanged by later calls.
def fast_inputs(r: int) -> list:
    rng = np.random.default_rng(100 + r)
    return [rng.random(1000).astype(np.float32), rng.random(7).astype(np.float32), np.zeros(0, np.float32),
            rng.random((3, 5)), np.array(r + 1, np.int32), rng.random(300000).astype(np.float32)]


fast = [tf.constant(a) for a in fast_inputs(me)]
fast_before = [t.numpy().copy() for t in fast]
firsts = [tfops.grouped_allreduce(fast, op=tfops.Sum, name="fast.group")]
firsts.append([tfops.allreduce(t, op=tfops.Sum, name=f"fast.{i}") for i, t in enumerate(fast)])
for first in firsts:
    for i, (y, t) in enumerate(zip(first, fast)):
        assert y.shape == t.shape and y.dtype == t.dtype, (i, y.shape, y.dtype)
        np.testing.assert_allclose(y.numpy(), sum(fast_inputs(r)[i].astype(np.float64) for r in range(p)),
                                   rtol=1e-5)
kept = [[y.numpy().copy() for y in first] for first in firsts]
for _ in range(3):                                   # later calls reuse the engine's memory if they may
    tfops.grouped_allreduce([t + 1 for t in fast], op=tfops.Sum, name="fast.group")
    [tfops.allreduce(t + 1, op=tfops.Sum, name=f"fast.{i}") for i, t in enumerate(fast)]
for first, saved in zip(firsts, kept):
    for y, k in zip(first, saved):
        np.testing.assert_array_equal(y.numpy(), k)
for t, b in zip(fast, fast_before):
    np.testing.assert_array_equal(t.numpy(), b)
digests = tfops.allgather_object([y.numpy().tobytes() for first in firsts for y in first])
assert all(d == digests[0] for d in digests), "eager results differ across ranks"

# Horovod's surface (issue 27): tests/mpi/tf_surface.py, on this initialised engine.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_surface  # noqa: E402

tf_surface.check_all()

if p > 1:
    # Same name, different shapes: the engine's MismatchError on every rank, eager and in a graph.
    bad = tf.zeros([me + 1])
    everyone_raised(MismatchError, lambda: tfops.allreduce(bad, name="shape.mismatch"), "shape.mismatch")
    everyone_raised(MismatchError, lambda: tf.function(lambda t: tfops.allreduce(t, name="g.mismatch"))(bad),
                    "g.mismatch")
    # A rank-dependent name never matches: StallError on every rank, once the engine is told to give up
    # (only here: on a loaded machine a short stall time would also fail a rank that is merely slow).
    tfops.shutdown()
    tfops.init(stall_shutdown_time=3.0)
    everyone_raised(StallError, lambda: tfops.allreduce(x, name=f"rank{me}.only"), f"rank{me}.only")
    # A different set of variables on one rank: DistributedOptimizer refuses it when it is built.
    variables = [keras.Variable(np.zeros(3, np.float32))] + ([keras.Variable(np.zeros(1, np.float32))] if me else [])
    opt = tfops.DistributedOptimizer(keras.optimizers.SGD(0.1))
    everyone_raised(MismatchError, lambda: opt.build(variables), "ranks train different variables")
    # The engine still works after all of that.
    np.testing.assert_allclose(tfops.allreduce(x, op=tfops.Sum).numpy(), xs.sum(0), rtol=1e-6)

tfops.shutdown()
print(f"rank {me}: tf_ops OK", flush=True)
sys.exit(0)
