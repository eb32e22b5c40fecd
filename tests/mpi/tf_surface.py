"""Rank script: tfops' Horovod surface (issue 27): queries, in-graph ops, Product, scale factors,
``average=``, grouped Min/Max/Product and slices, broadcast_ and friends, the timeline, error
types, averaged gradients, Compression on tensors, and the dtypes uint16/int16/bool.

``check_all()`` runs every check on an initialised tfops (tests/mpi/tf_ops.py calls it at
-np 1 and 3); run as a script it initialises tfops itself (tests/test_tf_rank_scripts.py: -np 2).
Expected values are closed forms over every rank's inputs (each rank can compute them all).
Prints "tf_surface OK" on every rank.
"""
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import allreduce as ar  # noqa: E402
import tfops  # noqa: E402
from allreduce.engine.timeline import timeline_path  # noqa: E402
import tfops.keras as hvd  # noqa: E402


def same_everywhere(a, what):
    got = tfops.allgather_object(np.asarray(a).tobytes())
    assert all(g == got[0] for g in got), f"{what}: ranks differ"


def raised_everywhere(kinds, fn, what):
    """fn() raises one of ``kinds`` on this rank; every rank agrees it did. Returns the error."""
    try:
        fn()
        error = None
    except kinds as exc:
        error = exc
    flags = tfops.allgather_object(error is not None)
    assert all(flags), f"{what}: not raised on every rank ({flags}); here: {error!r}"
    return error


def both_modes(fn, *args):
    """fn(*args) eagerly and inside a tf.function: both results, as numpy."""
    eager = fn(*args)
    graph = tf.function(fn)(*args)
    return tf.nest.map_structure(lambda t: np.asarray(t), (eager, graph))


def check_queries(p, me):
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not (hvd.nccl_built() or hvd.ccl_built() or hvd.rocm_built() or hvd.ddl_built() or hvd.sycl_built()
                or hvd.gloo_built() or hvd.gloo_enabled())
    from allreduce.device import num_devices
    assert hvd.cuda_built() == (num_devices() > 0)
    assert hvd.is_homogeneous() is (len(set(tfops.allgather_object(ar.local_size()))) == 1)
    ops = lambda: [hvd.size_op(), hvd.rank_op(), hvd.local_size_op(), hvd.local_rank_op()]  # noqa: E731
    for got in both_modes(ops):
        assert [int(v) for v in got] == [p, me, ar.local_size(), ar.local_rank()], got
    assert hvd.size_op().dtype == tf.int32 and hvd.rank_op().shape == []
    seen = []
    tf.function(lambda: seen.append(tfops._executing_eagerly()) or tf.constant(0))()   # traced: not eager
    assert tfops._executing_eagerly() and seen == [False], seen
    # cross_*: ranks sharing my local rank (one per node); reference: every rank's local rank
    every = tfops.allgather_object(ar.local_rank())
    assert hvd.cross_size() == every.count(ar.local_rank()) and hvd.cross_rank() == every[:me].count(ar.local_rank())
    assert tfops.cross_size() * ar.local_size() == p or not hvd.is_homogeneous()
    from tfops.collectives.queries import _cross                # 3 ranks on 2 nodes: (local_size, local_rank) per rank
    assert [_cross([(2, 0), (2, 1), (1, 0)], r) for r in range(3)] == [(0, 2), (0, 1), (1, 2)]


def check_product_and_scaling(p, me, W):
    xs = [np.array([[r + 2.0, 0.5 * (r + 1), 0.0 if r == p - 1 else 1.5]], np.float32) for r in range(p)]
    x = tf.constant(xs[me])

    def prod_grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = tfops.allreduce(t, op=tfops.Product)
            loss = tf.reduce_sum(y) * W[me]
        return y, tape.gradient(loss, t)
    want = np.prod(np.stack(xs), axis=0)
    others = np.stack([np.prod(np.stack([xs[r] for r in range(p) if r != me]), axis=0)]) if p > 1 \
        else np.ones_like(xs[0])
    for y, g in both_modes(prod_grad, x):
        np.testing.assert_allclose(y, want, rtol=1e-6)
        np.testing.assert_allclose(g, W.sum() * others.reshape(xs[0].shape), rtol=1e-5)

    # prescale/postscale, Horovod's arithmetic: integers in float64 then truncated, fp16 in float32.
    ints = [np.arange(-7, 10, dtype=np.int32) * (r + 1) for r in range(p)]
    want = sum(np.trunc(i.astype(np.float64) * 0.37).astype(np.int32) for i in ints)
    for got in both_modes(lambda t: tfops.allreduce(t, op=tfops.Sum, prescale_factor=0.37), tf.constant(ints[me])):
        np.testing.assert_array_equal(got, want)
    halves = [np.linspace(-3, 3, 11).astype(np.float16) * (r + 1) for r in range(p)]
    total = sum(h.astype(np.float32) for h in halves).astype(np.float16)     # p <= 3: exact in fp16
    want = (total.astype(np.float32) * np.float32(0.3)).astype(np.float16)
    for got in both_modes(lambda t: tfops.allreduce(t, op=tfops.Sum, postscale_factor=0.3), tf.constant(halves[me])):
        np.testing.assert_array_equal(got, want)

    def scaled_grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(tfops.allreduce(t, op=tfops.Sum, prescale_factor=2.0, postscale_factor=3.0)) * W[me]
        return tape.gradient(loss, t)
    for g in both_modes(scaled_grad, x):
        np.testing.assert_allclose(g, np.full(xs[0].shape, 6.0 * W.sum()), rtol=1e-6)

    # average= (deprecated): True/False map to Average/Sum; with op= it is a ValueError.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        np.testing.assert_allclose(tfops.allreduce(x, average=False), np.sum(xs, 0), rtol=1e-6)
        np.testing.assert_allclose(tfops.allreduce(x, average=True), np.mean(xs, 0), rtol=1e-6)
    try:
        tfops.allreduce(x, average=True, op=tfops.Sum)
        raise AssertionError("average= with op= accepted")
    except ValueError as exc:
        assert "supersedes" in str(exc)
    np.testing.assert_allclose(tfops.allreduce(x, device_dense="/cpu:0", device_sparse="/cpu:0"),
                               np.mean(xs, 0), rtol=1e-6)


def check_grouped(p, me, W):
    xs = [np.array([r - 1.0, 2.0 * r, -r], np.float32) for r in range(p)]
    x = tf.constant(xs[me])
    for op, ref in ((tfops.Min, np.min), (tfops.Max, np.max), (tfops.Product, np.prod)):
        def run(t):
            with tf.GradientTape() as tape:
                tape.watch(t)
                a, b = tfops.grouped_allreduce([t, 2.0 * t], op=op, prescale_factor=1.0)
                loss = (tf.reduce_sum(a) + tf.reduce_sum(b)) * W[me]
            return a, b, tape.gradient(loss, t)
        for a, b, g in both_modes(run, x):
            np.testing.assert_allclose(a, ref(np.stack(xs), 0), rtol=1e-6)
            np.testing.assert_allclose(b, ref(2 * np.stack(xs), 0), rtol=1e-6)
            if op == tfops.Max:      # ties share: rank r wins where it holds the maximum
                wins = (xs[me] == np.max(np.stack(xs), 0)).astype(np.float32)
                np.testing.assert_allclose(g, W.sum() * 3 * wins, rtol=1e-6)
    # slices inside a group: allgathered next to the dense ones; Min on them is NotImplementedError.
    sl = tf.IndexedSlices(tf.constant([[me + 1.0, 1.0]]), tf.constant([me]), tf.constant([p, 2]))
    dense, sparse = tfops.grouped_allreduce([x, sl], op=tfops.Sum)
    np.testing.assert_allclose(dense, np.sum(xs, 0), rtol=1e-6)
    assert isinstance(sparse, tf.IndexedSlices)
    np.testing.assert_array_equal(tf.convert_to_tensor(sparse), [[r + 1.0, 1.0] for r in range(p)])
    for op in (tfops.Min, tfops.Max, tfops.Product):
        for call in (lambda: tfops.grouped_allreduce([x, sl], op=op), lambda: tfops.allreduce(sl, op=op)):
            try:
                call()
                raise AssertionError(f"{op!r} on slices accepted")
            except NotImplementedError:
                pass
    try:
        tfops.allreduce(sl, op=tfops.Sum, prescale_factor=0.5)
        raise AssertionError("prescale on slices accepted")
    except NotImplementedError:
        pass


def check_broadcasts(p, me, W):
    root = p - 1
    v = tf.Variable(np.full(3, me, np.float32))
    k = tf.Variable(np.array([me, me], np.int64))
    values = hvd.broadcast_([v, k], root_rank=root)
    np.testing.assert_array_equal(v.numpy(), np.full(3, root))
    np.testing.assert_array_equal(values[1], [root, root])
    v.assign(np.full(3, me, np.float32))
    got = tf.function(lambda: hvd.broadcast_([v], root_rank=0))()
    np.testing.assert_array_equal(got[0], np.zeros(3))
    np.testing.assert_array_equal(v.numpy(), np.zeros(3))
    try:
        hvd.broadcast_global_variables(0)
        raise AssertionError("broadcast_global_variables ran eagerly")
    except RuntimeError as exc:
        assert "eager" in str(exc)
    assert hvd.broadcast_object_fn(root_rank=root)({"from": me}) == {"from": root}

    # Gradients average (Horovod's): allgather keeps this rank's rows of the mean, broadcast's
    # root gets the mean and the others 0.
    def gather_grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(tfops.allgather(t)) * W[me]
        return tape.gradient(loss, t)

    def bcast_grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(tfops.broadcast(t, root_rank=root)) * W[me]
        return tape.gradient(loss, t)
    rows = tf.ones([me + 1, 2])
    for g in both_modes(gather_grad, rows):
        np.testing.assert_allclose(g, np.full((me + 1, 2), W.mean()), rtol=1e-6)
    for g in both_modes(bcast_grad, tf.ones([2])):
        np.testing.assert_allclose(g, np.full(2, W.mean() if me == root else 0.0), rtol=1e-6)


def check_timeline(p, me):
    path = os.path.join(tempfile.gettempdir(), f"tf_surface_{tfops.broadcast_object(os.getpid())}.json")
    hvd.start_timeline(path, mark_cycles=True)
    tfops.allreduce(tf.ones([4]), name="timeline.probe")
    hvd.stop_timeline()
    mine = timeline_path(path, me)
    with open(mine) as f:
        text = f.read()
    assert "timeline.probe" in text and "CYCLE_START" in text and text.rstrip().endswith("]"), text[-300:]
    tfops.allreduce(tf.ones([4]), name="timeline.after")           # the engine goes on without it
    os.remove(mine)


def check_compression_on_tensors():
    t = tf.constant([1.5, -2.25, 3.0], tf.float32)
    for comp, wire in ((hvd.Compression.fp16, tf.float16), (hvd.Compression.bf16, tf.bfloat16)):
        def roundtrip(t, comp=comp):
            c, ctx = comp.compress(t)
            return c, comp.decompress(c, ctx)
        for c, back in both_modes(roundtrip, t):
            assert c.dtype == wire.as_numpy_dtype and back.dtype == np.float32
            np.testing.assert_array_equal(back, [1.5, -2.25, 3.0])
        ints, ctx = comp.compress(tf.constant([1, 2]))
        assert ints.dtype == tf.int32 and ctx is None
        payload, ctx = comp.compress(np.array([1.5], np.float32))          # the engine's numpy path
        assert isinstance(payload, np.ndarray) and comp.decompress(payload, ctx).dtype == np.float32
    c, ctx = hvd.Compression.none.compress(t)
    assert c is t and hvd.Compression.none.decompress(c, ctx) is t
    y = tfops.allreduce(t, op=tfops.Sum, compression=hvd.Compression.fp16)
    np.testing.assert_allclose(y, t.numpy() * tfops.size(), rtol=1e-3)


def check_dtypes(p, me):
    for dtype in (tf.uint16, tf.int16):
        x = tf.constant(np.arange(5) * (me + 1), dtype)
        want = (np.arange(5)[None] * np.arange(1, p + 1)[:, None]).astype(dtype.as_numpy_dtype)
        for got in both_modes(lambda t: tfops.allreduce(t, op=tfops.Sum), x):
            np.testing.assert_array_equal(got, want.sum(0).astype(dtype.as_numpy_dtype))
        np.testing.assert_array_equal(tfops.allreduce(x, op=tfops.Max), want.max(0))
        np.testing.assert_array_equal(tfops.allgather(x), want.reshape(-1))
        np.testing.assert_array_equal(tfops.broadcast(x, 0), want[0])
    bits = [np.array([r % 2 == 0, False, True, r == 0]) for r in range(p)]
    b = tf.constant(bits[me])
    for op, ref in ((tfops.Sum, np.any), (tfops.Max, np.any), (tfops.Min, np.all), (tfops.Product, np.all)):
        for got in both_modes(lambda t, op=op: tfops.allreduce(t, op=op), b):
            np.testing.assert_array_equal(got, ref(np.stack(bits), 0))
            same_everywhere(got, f"bool {op!r}")
    np.testing.assert_array_equal(tfops.broadcast(b, p - 1), bits[p - 1])
    np.testing.assert_array_equal(tfops.allgather(b), np.concatenate(bits))
    raised_everywhere(TypeError, lambda: tfops.allreduce(b, op=tfops.Average), "Average of bool")


def check_errors(p, me):
    """Ranks that disagree: tfops.MismatchError, both FailedPreconditionError and ar.MismatchError,
    on every rank; inside tf.function an OpError that names it."""
    kinds = (tf.errors.FailedPreconditionError,)
    cases = [
        ("same count, other shape", lambda: tfops.allreduce(tf.ones([2, 3] if me == 0 else [3, 2]))),
        ("other dtype", lambda: tfops.allreduce(tf.ones([3], tf.float32 if me == 0 else tf.float64))),
        ("broadcast shape", lambda: tfops.broadcast(tf.ones([2, 3] if me == 0 else [6]), 0)),
        ("broadcast root", lambda: tfops.broadcast(tf.ones([3]), me % 2)),
        ("allgather rows", lambda: tfops.allgather(tf.ones([2, me + 1]))),
        ("grouped shapes", lambda: tfops.grouped_allreduce([tf.ones([me + 1])])),
    ]
    for what, fn in cases:
        error = raised_everywhere(kinds, fn, what)
        assert isinstance(error, ar.MismatchError) and isinstance(error, tfops.MismatchError), repr(error)
        assert "rank 0" in str(error) and "rank 1" in str(error), str(error)
    error = raised_everywhere(tf.errors.OpError, tf.function(lambda: tfops.allreduce(tf.ones([me + 1]))),
                              "in tf.function")
    assert "MismatchError" in str(error) and "rank 1" in str(error), str(error)


def check_tf1_graph(p, me):
    """A TF1 graph (tf.compat.v1 Session, one inter-op thread): several collectives in one run,
    fetched in another order on odd ranks, run in creation order everywhere (tfops.collectives.graph_order);
    broadcast's gradient runs its allreduce on the non-root ranks too (TF would prune it)."""
    g = tf.Graph()
    with g.as_default():
        xs = [tf.ones([3], d) * tf.cast(me + 1, d) for d in (tf.float32, tf.int32, tf.float64, tf.int64)]
        ys = [tfops.allreduce(x, op=tfops.Sum) for x in xs]
        v = tf.constant([1.0, 2.0]) * (me + 1)
        b = tfops.broadcast(v, p - 1)
        grad = tf.gradients(b, v, tf.ones([2]))[0]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=g, config=config) as session:
            got = session.run(ys if me % 2 == 0 else ys[::-1])
            got_b, got_grad = session.run([b, grad])
    assert all(y.tolist() == [p * (p + 1) // 2] * 3 for y in got), got
    assert got_b.tolist() == [p, 2.0 * p], got_b
    assert got_grad.tolist() == ([1.0, 1.0] if me == p - 1 else [0.0, 0.0]), got_grad


def check_out_of_step(p, me):
    """Rank 0 waits for one name, the others for another (as after a failed step): both fail on
    every rank within seconds, saying the ranks are out of step; then the ranks are in step again."""
    error = raised_everywhere(ar.StallError, lambda: tfops.allreduce(tf.ones([2]), name=f"oos.{min(me, 1)}"),
                              "out of step")
    assert "out of step" in str(error) and "'oos.0' submitted by rank(s) 0" in str(error), str(error)
    # rank 0 went on to a direct-path collective (allgather), the others to an engine allreduce:
    # the direct call's rendezvous (tfops.collectives.dispatch.in_step) shows the engine who waits for what
    # (both named: an automatic name advances a counter that the rank which went on would leave
    # ahead of the others for good, as Horovod's auto-names would; allgather takes one whatever the dtype)
    start = time.monotonic()
    error = raised_everywhere(ar.StallError, lambda: tfops.allgather(tf.ones([2], tf.int32), name="oos.gather")
                              if me == 0 else tfops.allreduce(tf.ones([2]), name="oos.next"), "direct against engine")
    assert time.monotonic() - start < 25, "out of step must fail long before the transport timeout"
    assert "out of step" in str(error) and "'tfops.direct' submitted by rank(s) 0" in str(error), str(error)
    # two direct-path collectives of different kinds: the metadata check names each rank's
    error = raised_everywhere(ar.MismatchError, lambda: tfops.allgather(tf.ones([2], tf.int32)) if me == 0
                              else tfops.broadcast(tf.ones([2], tf.int32), 0), "allgather against broadcast")
    kinds = ", ".join(f"rank {r}: {'allgather' if r == 0 else 'broadcast'}" for r in range(p))
    assert "the ranks are out of step" in str(error) and kinds in str(error), str(error)
    got = tfops.allgather(tf.ones([1]) * me).numpy().tolist()          # in step again
    assert got == list(range(p)), got


def check_in_fit(p, me):
    """Inside model.fit: a layer that reduces with prescale, postscale and average=False and reads
    size_op; every rank ends with the same weights."""
    import keras

    def reduce(t):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            y = hvd.allreduce(t, average=False, prescale_factor=0.5, postscale_factor=2.0)
        return y / tf.cast(hvd.size_op(), y.dtype)                         # the mean of every rank's t
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Lambda(reduce)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    hvd.broadcast_variables(model.variables, root_rank=0)
    # The same inputs everywhere, a different target per rank: the weights stay equal only because
    # the gradient of the reduction sums every rank's upstream gradient.
    x = np.random.default_rng(0).random((8, 3), np.float32)
    y = np.random.default_rng(me).random((8, 2), np.float32)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for v in model.trainable_variables:
        same_everywhere(v.numpy(), f"model.fit weight {v.name}")


def check_all():
    p, me = tfops.size(), tfops.rank()
    W = np.arange(1, p + 1, dtype=np.float64)           # rank k weights its loss by k + 1
    check_queries(p, me)
    check_product_and_scaling(p, me, W)
    check_grouped(p, me, W)
    check_broadcasts(p, me, W)
    check_timeline(p, me)
    check_compression_on_tensors()
    check_dtypes(p, me)
    check_in_fit(p, me)
    check_tf1_graph(p, me)
    if p > 1:
        check_errors(p, me)
        check_out_of_step(p, me)
    np.testing.assert_allclose(tfops.allreduce(tf.ones([2]), op=tfops.Sum), [p, p])   # still in step


if __name__ == "__main__":
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tfops.init()
    rank = tfops.rank()
    check_all()
    tfops.shutdown()
    print(f"rank {rank}: tf_surface OK", flush=True)
    sys.exit(0)
