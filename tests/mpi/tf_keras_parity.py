"""Rank script: the Keras side of Horovod's API (issue 27) against single-process math.

Run by tests/test_tf_rank_scripts.py (through tf_in_turn.py) without mpirun and as ``mpirun -np P python tf_keras_parity.py``
(P = 2, 3). Every rank generates every rank's data (one seeded stream), so each
reference (numpy float64, or plain Keras on the global batch) is computed locally. Checks:

1. DistributedGradientTape: gradient_predivide_factor, num_groups, groups= and
   register_local_source (eager and tf.function); PartialDistributedGradientTape.
2. DistributedOptimizer: backward_passes_per_step with local variables, through Horovod's
   _compute_gradients + apply_gradients in tf.function (values, iterations, _agg_helper.counter);
   an inf gradient does not leak into the next cycle; sparse_as_dense + aggregation in
   model.fit equals plain Keras on the global batch; predivide/num_groups in model.fit;
   PartialDistributedOptimizer; get_config round trip.
3. Callbacks: LearningRateScheduleCallback (staircase, callable, per batch),
   BroadcastGlobalVariablesCallback(local_variables=), BestModelCheckpoint on rank 0 only.
4. SyncBatchNormalization: outputs and moving statistics equal Keras' BatchNormalization on the
   global batch (equal and unequal batches; in model.fit too).
5. hvd.load_model: the optimizer comes back wrapped, with its state.
6. Bad arguments raise on every rank.
7. mixed_float16 loss scaling with DistributedOptimizer and ShardedOptimizer in both wrapping
   orders, and a rank-local overflow skipped on every rank (tests/mpi/mixed_precision_check.py).
Prints "tf_keras_parity OK" on every rank at the end.
"""
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import tfops  # noqa: E402
import tfops.keras as hvd  # noqa: E402

hvd.init()
p, me = hvd.size(), hvd.rank()
rng = np.random.default_rng(11)
X = rng.standard_normal((p, 6, 4)).astype(np.float32)         # rank r's batch: X[r]
W0 = rng.standard_normal((4, 3)).astype(np.float32)


def close(got, want, what, rtol=1e-5, atol=1e-6):
    if isinstance(want, list) and len(want) and np.ndim(want[0]) > 0:
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            close(g, w, f"{what} [{i}]", rtol, atol)
        return
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol,
                               err_msg=f"rank {me}: {what}")


def same_everywhere(arrays, what):
    digest = [np.asarray(a).tobytes() for a in arrays]
    assert tfops.allgather_object(digest) == [digest] * p, f"{what}: ranks differ"


def local_grads(r):
    """d/dW and d/db of sum(tanh(X[r] @ W + b) ** 2), float64: rank r's gradients."""
    z = X[r].astype(np.float64) @ W0 + 0.5
    d = 2 * np.tanh(z) * (1 - np.tanh(z) ** 2)
    return X[r].T.astype(np.float64) @ d, d.sum(0)


def tape_grads(make_tape, in_function=False):
    w, b = tf.Variable(W0), tf.Variable(tf.fill([3], 0.5))

    def run():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.tanh(X[me] @ w + b) ** 2)
        return make_tape(t, w, b).gradient(loss, [w, b])
    out = tf.function(run)() if in_function else run()
    return [g.numpy() for g in out]


# -- 1. the tape ------------------------------------------------------------------------------------
avg = [np.mean([local_grads(r)[i] for r in range(p)], 0) for i in range(2)]
mine = local_grads(me)
for kwargs in ({}, {"gradient_predivide_factor": 4.0}, {"num_groups": 2}, {"groups": 1}):
    for fn in (False, True):
        got = tape_grads(lambda t, w, b: tfops.DistributedGradientTape(t, **kwargs), fn)
        close(got[0], avg[0], f"tape {kwargs} {fn}")
        close(got[1], avg[1], f"tape {kwargs} {fn}")
        same_everywhere(got, f"tape {kwargs}")


def with_local_b(t, w, b):
    tape = tfops.DistributedGradientTape(t, groups=[[w]])
    tape.register_local_source(b)
    return tape


for fn in (False, True):
    got = tape_grads(with_local_b, fn)
    close(got[0], avg[0], "tape, w reduced")
    close(got[1], mine[1] / p, "tape, b local (divided by size)")

layer_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
layer_model.set_weights([np.full(w.shape, me + 1.0, np.float32) for w in layer_model.get_weights()])
with tf.GradientTape() as t:
    loss = tf.reduce_sum(layer_model(X[me]) ** 2)
plain = t.gradient(loss, layer_model.trainable_variables)
with tf.GradientTape() as t:
    loss = tf.reduce_sum(layer_model(X[me]) ** 2)
partial = tfops.PartialDistributedGradientTape(t, local_layers=layer_model.layers[1]).gradient(
    loss, layer_model.trainable_variables)
every = tfops.allgather_object([g.numpy() for g in plain])
for i, (g, pg) in enumerate(zip(plain, partial)):
    want = g.numpy() / p if i >= 2 else np.mean([e[i] for e in every], 0)
    close(pg, want, f"partial tape variable {i}", rtol=1e-5, atol=1e-4)

# -- 2. the optimizer -------------------------------------------------------------------------------


class AddGradient(keras.optimizers.Optimizer):
    """var += grad: the applied gradient is visible in the variable (Horovod's TestingOptimizer)."""

    def __init__(self):
        super().__init__(learning_rate=0.0, name="add_gradient")

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(gradient)


N = 3
for average in (False, True):
    opt = hvd.DistributedOptimizer(AddGradient(), backward_passes_per_step=N,
                                   average_aggregated_gradients=average, sparse_as_dense=True)
    xs = [tf.Variable([0.0]) for _ in range(2)]
    ys = [tf.Variable([1.0, 2.0]) for _ in range(2)]
    opt.register_local_var(xs[0])
    opt.register_local_var(ys[0])

    def loss():             # d/dx = rank + 1, d/dy = [-(rank + 1) via tf.gather (IndexedSlices), 0]
        return sum(tf.reduce_sum(x * (me + 1.0) - tf.gather(y, [0]) * (me + 1.0)) for x, y in zip(xs, ys))

    @tf.function
    def step():
        opt.apply_gradients(opt._compute_gradients(loss, var_list=[xs, ys]), experimental_aggregate_gradients=False)
    for i in range(7):
        step()
        cycles = (i + 1) // N
        scale = cycles * (1.0 if average else N)
        shared, own = (p + 1) / 2.0, (me + 1.0) / p        # averaged gradient, local gradient / size
        close([xs[0].numpy()[0], xs[1].numpy()[0]], [scale * own, scale * shared], f"bpps x, pass {i}")
        close([ys[0].numpy()[0], ys[1].numpy()[0]], [1 - scale * own, 1 - scale * shared], f"bpps y, pass {i}")
        assert int(opt.iterations.numpy()) == i + 1 and int(opt._agg_helper.counter.numpy()) == (i + 1) % N

inf_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
v = tf.Variable(0.0)
for i in range(4):             # the first cycle's gradient is inf; the second's must be finite
    pairs = inf_opt._compute_gradients(lambda: v * (float("inf") if i == 0 else 1.0), var_list=[v])
    inf_opt.apply_gradients(pairs)
assert np.isfinite(pairs[0][0].numpy()) and pairs[0][0].numpy() == 2.0, pairs[0][0]


def embedder(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


ids = rng.integers(0, 20, (4, p, 2, 3)).astype(np.int32)           # pass, rank, batch, 3
target = rng.standard_normal((4, p, 2, 1)).astype(np.float32)
emb = embedder(0)
emb_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.3), sparse_as_dense=True, backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
emb.compile(optimizer=emb_opt, loss="mse", jit_compile=False)
for s in range(3):
    emb.train_on_batch(ids[s, me], target[s, me])
assert int(emb_opt._agg_helper.counter.numpy()) == 1 and int(emb_opt.iterations.numpy()) == 3
ref, ref_opt = embedder(0), keras.optimizers.SGD(0.3)
with tf.GradientTape() as t:       # one update on passes 0 and 1 of every rank = the global batch
    loss = keras.losses.MeanSquaredError()(target[:2].transpose(1, 0, 2, 3).reshape(-1, 1),
                                           ref(ids[:2].transpose(1, 0, 2, 3).reshape(-1, 3)))
ref_opt.apply(t.gradient(loss, ref.trainable_variables), ref.trainable_variables)
close(emb.get_weights()[0], ref.get_weights()[0], "sparse_as_dense + aggregation in model.fit", atol=1e-5)


def fit_mlp(opt, seed=3, fit=True):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    if fit:
        model.fit(X[me], X[me].sum(1, keepdims=True), batch_size=3, epochs=1, shuffle=False, verbose=0)
    return model


plain_w = fit_mlp(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))).get_weights()
got = fit_mlp(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), gradient_predivide_factor=2.0,
                                       num_groups=3)).get_weights()
close(got, plain_w, "model.fit with gradient_predivide_factor and num_groups")
same_everywhere(got, "model.fit with gradient_predivide_factor and num_groups")
keras.utils.set_random_seed(3)
part = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
part_opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[part.layers[1]])
part.compile(optimizer=part_opt, loss="mse", jit_compile=False)
part.fit(X[me], X[me].sum(1, keepdims=True), batch_size=6, epochs=1, verbose=0)
same_everywhere(part.get_weights()[:2], "partial optimizer, shared layer")
if p > 1:
    assert len(set(tfops.allgather_object(part.get_weights()[2].tobytes()))) == p, "local layer was reduced"
cfg = hvd.DistributedOptimizer(keras.optimizers.Adam(), gradient_predivide_factor=2.0).get_config()
assert type(hvd.DistributedOptimizer(keras.optimizers.Adam())).from_config(cfg).get_config() == cfg

# -- 3. callbacks -----------------------------------------------------------------------------------


class LrLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))


lr_model = fit_mlp(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), fit=False)
log = LrLog()
schedules = [hvd.callbacks.LearningRateScheduleCallback(0.4, 0.5, start_epoch=1, end_epoch=3),
             hvd.callbacks.LearningRateScheduleCallback(0.4, lambda e: 1.0 / (1 + e), start_epoch=3,
                                                        staircase=False)]
history = lr_model.fit(X[me], X[me][:, :1], batch_size=3, epochs=5, shuffle=False, verbose=0,
                       callbacks=schedules + [log])
want = [0.1, 0.1] + [0.4, 0.4, 0.2, 0.2] + [0.4 / (1 + e + b / 2) for e in (3, 4) for b in (0, 1)]
close(log.lrs, want, "LearningRateScheduleCallback")
close(history.history["lr"][1:3], [0.4, 0.2], "logs['lr']")

bcast = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, trainable=False), keras.layers.Dense(2)])
bcast.set_weights([np.full(w.shape, float(me), np.float32) for w in bcast.get_weights()])
bcast.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=False)
local = list(bcast.layers[0].variables)
bcast.fit(X[me][:, :3], X[me][:, :2], verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=p - 1, local_variables=local)])
for i, w in enumerate(bcast.get_weights()):
    assert np.all(w == (me if i < 2 else p - 1)), f"rank {me}: broadcast with local_variables, weight {i}"

tmp = tempfile.mkdtemp()
best = fit_mlp(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), fit=False)
path = os.path.join(tmp, f"best_{me}.keras")
best.fit(X[me], X[me].sum(1, keepdims=True), validation_data=(X[me], X[me].sum(1, keepdims=True)), epochs=2,
         verbose=0, callbacks=[hvd.callbacks.MetricAverageCallback(), hvd.callbacks.BestModelCheckpoint(filepath=path)])
assert os.path.exists(path) == (me == 0), f"rank {me}: BestModelCheckpoint wrote {path}: {os.path.exists(path)}"

# -- 4. SyncBatchNormalization ----------------------------------------------------------------------
for sizes in ([2] * p, [r + 1 for r in range(p)]):                   # equal and unequal batches
    rows = [rng.standard_normal((n, 3, 2)).astype(np.float32) * 3 + 1 for n in sizes]
    sync, bn = hvd.SyncBatchNormalization(axis=-1, momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)
    out = sync(rows[me], training=True)
    ref_out = bn(np.concatenate(rows), training=True)
    close(out, np.split(ref_out.numpy(), np.cumsum(sizes)[:-1])[me], f"SyncBatchNormalization {sizes}", atol=1e-5)
    close(sync.moving_mean, bn.moving_mean, "moving mean", atol=1e-5)
    close(sync.moving_variance, bn.moving_variance, "moving variance", atol=1e-5)
    close(sync(rows[me], training=False), bn(rows[me], training=False), "inference", atol=1e-5)


def bn_model(layer):
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), layer, keras.layers.Dense(1)])


sync_model = bn_model(hvd.SyncBatchNormalization())
sync_model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False)
sync_model.fit(X[me], X[me][:, :1], batch_size=6, epochs=2, verbose=0)
ref = bn_model(keras.layers.BatchNormalization())          # one process, global batch; loss = mean of ranks'
ref_opt = keras.optimizers.SGD(0.1)
for _ in range(2):
    with tf.GradientTape() as t:
        loss = keras.losses.MeanSquaredError()(X[:, :, :1].reshape(-1, 1), ref(X.reshape(-1, 4), training=True))
    ref_opt.apply(t.gradient(loss, ref.trainable_variables), ref.trainable_variables)
close(sync_model.get_weights(), ref.get_weights(), "SyncBatchNormalization in model.fit", atol=1e-5)

# -- 5. load_model ----------------------------------------------------------------------------------
saved = os.path.join(tempfile.gettempdir(), f"tfops_keras_parity_{tfops.broadcast_object(os.getpid())}.keras")
for inner_only in (True, False):
    source = fit_mlp(keras.optimizers.Adam(0.01) if inner_only else hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    if me == 0:
        source.save(saved)
    tfops.broadcast_object(None)                            # barrier: the file is written
    loaded = hvd.load_model(saved)
    assert isinstance(loaded.optimizer, tfops.training.optimizer.DistributedOptimizerWrapper), type(loaded.optimizer)
    assert int(loaded.optimizer.iterations.numpy()) == 2, loaded.optimizer.iterations
    loaded.fit(X[me], X[me].sum(1, keepdims=True), batch_size=3, verbose=0)
    same_everywhere(loaded.get_weights(), "load_model, then fit")
    tfops.broadcast_object(None)
if me == 0:
    os.remove(saved)

# -- 6. bad arguments raise on every rank -----------------------------------------------------------
bad = [(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum, gradient_predivide_factor=2)),
       (ValueError, lambda: tfops.DistributedGradientTape(tf.GradientTape(), num_groups=-1)),
       (ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)),
       (ValueError, lambda: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(), local_layers=["dense"])),
       (ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(),
                                                     hooks=tfops.GradientHooks(layer_model)).register_local_var(v)),
       (TypeError, lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))),
       (ValueError, lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5))]
for i, (kind, make) in enumerate(bad):
    try:
        make()
    except kind as exc:
        assert str(exc), i
    else:
        raise AssertionError(f"rank {me}: bad argument {i} did not raise {kind.__name__}")

# -- 7. mixed precision in both wrapping orders (its own file; run here to share this launch) -------
import mixed_precision_check  # noqa: E402

mixed_precision_check.run()

hvd.shutdown()
print(f"rank {me}: tf_keras_parity OK", flush=True)
