"""Rank script: data-parallel training with tfops equals single-process training on the global batch.

Run by tests/test_tf_rank_scripts.py (through tf_in_turn.py) as ``mpirun -np P python tf_train.py``. Each rank
generates every rank's data (one seeded stream), trains on its own shard
with tfops, and trains a plain Keras reference on the concatenated global
batch, locally. Checks, in order:

1. model.fit + DistributedOptimizer(SGD momentum) + the three callbacks: same weights as the
   reference (float32 tolerance); weights bitwise identical across ranks after every step;
   logs averaged over ranks; warmup learning rates follow Goyal et al.
2. DistributedGradientTape, GradientHooks (both in tf.function), DistributedOptimizer.apply
   (eager; also Adam) and model.fit with DistributedOptimizer(hooks=...): each matches the
   reference, and the paths agree with each other. The tape also with a bucket per gradient
   (tfops.training.overlap: the graph has the submits' control edges) and with num_groups=1.
3. Sparse embedding gradients, allgathered and with sparse_as_dense=True; an embedding under two
   dense layers with a bucket per gradient in a tf.function (no cycle; the submits still come first).
4. backward_passes_per_step=2 with averaged aggregation = one step on both micro-batches.
5. examples/keras_digits.py reaches the single-process test accuracy within 1 point.
6. examples/custom_loop.py trains with DistributedGradientTape and with GradientHooks.
Prints "tf_train OK" on every rank at the end.
"""
import hashlib
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import tfops  # noqa: E402
import tfops.keras as hvd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import keras_digits  # noqa: E402

hvd.init()
p, me = hvd.size(), hvd.rank()
B, STEPS = 8, 6                                    # per-rank batch, steps
rng = np.random.default_rng(7)
X = rng.standard_normal((STEPS, p, B, 5)).astype(np.float32)
Y = (X.sum(-1) > 0).astype(np.int64)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(2)])


def reference(optimizer, steps=STEPS, build=mlp) -> list[np.ndarray]:
    """Plain Keras, one process, on the global batch of every step; starts from rank 0's seed."""
    model = build(0)
    for s in range(steps):
        xb, yb = X[s].reshape(p * B, -1), Y[s].reshape(p * B)
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return [v.numpy() for v in model.trainable_variables]


def assert_close(got, want, what, rtol=1e-5, atol=1e-6):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=atol, err_msg=what)


def assert_same_on_every_rank(arrays, what):
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()
    digests = tfops.allgather_object(digest)
    assert len(set(digests)) == 1, f"{what}: weights differ bitwise across ranks: {digests}"


# -- 1. model.fit with DistributedOptimizer and the callbacks ------------------------------------
class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.digests, self.lrs, self.logs = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_train_batch_end(self, batch, logs=None):
        data = b"".join(v.numpy().tobytes() for v in self.model.trainable_variables)
        self.digests.append(hashlib.sha256(data).hexdigest())

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


HALF = STEPS // 2                                  # fit: 2 epochs of HALF steps each
model = mlp(100 + me)                              # different on every rank until the broadcast
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss=LOSS,
              jit_compile=False)
record = Record()
warmup = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1)
model.fit(X[:HALF, me].reshape(-1, 5), Y[:HALF, me].reshape(-1), batch_size=B, epochs=2, shuffle=False,
          verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), warmup,
                                hvd.callbacks.MetricAverageCallback(), record])
lrs = [0.1 * warmup.multiplier(b / HALF) for b in range(HALF)] + [0.1] * HALF
np.testing.assert_allclose(record.lrs, lrs, rtol=1e-6)
assert abs(record.lrs[0] - 0.1 / p * (1 + (p - 1) / HALF)) < 1e-7, record.lrs    # Horovod's: epoch + 1/steps
assert len(record.digests) == 2 * HALF
assert tfops.allgather_object(record.digests) == [record.digests] * p, "weights differ across ranks after a step"
assert tfops.allgather_object(record.logs) == [record.logs] * p, "MetricAverageCallback left logs rank-local"

ref_model, ref_opt = mlp(100), keras.optimizers.SGD(0.1, momentum=0.9)     # rank 0's initial weights
for step, s in enumerate(list(range(HALF)) * 2):
    ref_opt.learning_rate = lrs[step]
    with tf.GradientTape() as tape:
        loss = LOSS(Y[s].reshape(-1), ref_model(X[s].reshape(p * B, -1), training=True))
    ref_opt.apply(tape.gradient(loss, ref_model.trainable_variables), ref_model.trainable_variables)
assert_close(model.trainable_variables, [v.numpy() for v in ref_model.trainable_variables], "model.fit")

# -- 2. tape, hooks and optimizer paths --------------------------------------------------------
want_sgd = reference(keras.optimizers.SGD(0.2))
x_mine, y_mine = X[:, me], Y[:, me]

tape_model, tape_opt = mlp(0), keras.optimizers.SGD(0.2)


@tf.function
def tape_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = LOSS(yb, tape_model(xb, training=True))
    grads = tfops.DistributedGradientTape(tape).gradient(loss, tape_model.trainable_variables)
    tape_opt.apply(grads, tape_model.trainable_variables)


# The same tape with every gradient its own bucket (tfops.training.overlap), and with one grouped call after
# backprop (num_groups=1): the buckets' submits must come first in the graph's order.
bucket_model, bucket_opt = mlp(0), keras.optimizers.SGD(0.2)
one_model, one_opt = mlp(0), keras.optimizers.SGD(0.2)


@tf.function
def bucket_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = LOSS(yb, bucket_model(xb, training=True))
    grads = tfops.DistributedGradientTape(tape).gradient(loss, bucket_model.trainable_variables)
    bucket_opt.apply(grads, bucket_model.trainable_variables)


@tf.function
def one_call_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = LOSS(yb, one_model(xb, training=True))
    grads = tfops.DistributedGradientTape(tape, num_groups=1).gradient(loss, one_model.trainable_variables)
    one_opt.apply(grads, one_model.trainable_variables)


from tfops.training import overlap  # noqa: E402
shapes = [tf.TensorSpec(s, tf.float32) for s in ((300,), (5,), (200, 2), (7,))]
assert overlap.buckets(shapes, 1000) == [[3, 2], [1, 0]], overlap.buckets(shapes, 1000)   # last first, 1000 B
assert overlap.buckets(shapes, 1) == [[3], [2], [1], [0]] and overlap.buckets(shapes[:0], 1) == []
overlap.BUCKET_BYTES, saved_bucket = 1, overlap.BUCKET_BYTES
try:
    graph = bucket_step.get_concrete_function(tf.TensorSpec((B, 5)), tf.TensorSpec((B,), tf.int64)).graph
finally:
    overlap.BUCKET_BYTES = saved_bucket
submits = {op for op in graph.get_operations() if op.name.startswith("tfops_grad_submit")}
waiting = [op for op in graph.get_operations() if op.type != "PyFunc" and submits & set(op.control_inputs)]
assert len(submits) == 4 and waiting, f"{len(submits)} bucket submits, {len(waiting)} ops ordered after them"

hook_model, hook_opt = mlp(0), keras.optimizers.SGD(0.2)
hooks = tfops.GradientHooks(hook_model)


@tf.function
def hook_step(xb, yb):
    with tf.GradientTape() as tape:
        with hooks.forward():
            loss = LOSS(yb, hook_model(xb, training=True))
    grads = hooks.wait(tape.gradient(loss, hook_model.trainable_variables))
    hook_opt.apply(grads, hook_model.trainable_variables)


opt_model, dist_opt = mlp(0), tfops.DistributedOptimizer(keras.optimizers.SGD(0.2))
for s in range(STEPS):
    tape_step(x_mine[s], y_mine[s])
    bucket_step(x_mine[s], y_mine[s])
    one_call_step(x_mine[s], y_mine[s])
    hook_step(x_mine[s], y_mine[s])
    with tf.GradientTape() as tape:                # eager
        loss = LOSS(y_mine[s], opt_model(x_mine[s], training=True))
    dist_opt.apply_gradients(zip(tape.gradient(loss, opt_model.trainable_variables), opt_model.trainable_variables))
    for m in (tape_model, bucket_model, one_model, hook_model, opt_model):
        assert_same_on_every_rank([v.numpy() for v in m.trainable_variables], f"step {s}")
fit_model = mlp(0)                                 # model.fit with the hooks: the optimizer waits for them
fit_model.compile(optimizer=tfops.DistributedOptimizer(keras.optimizers.SGD(0.2), hooks=tfops.GradientHooks(fit_model)),
                  loss=LOSS, jit_compile=False)
fit_model.fit(x_mine.reshape(-1, 5), y_mine.reshape(-1), batch_size=B, shuffle=False, verbose=0)
assert_same_on_every_rank([v.numpy() for v in fit_model.trainable_variables], "fit with hooks")
paths = {name: [v.numpy() for v in m.trainable_variables]
         for name, m in [("tape", tape_model), ("tape, a bucket per gradient", bucket_model),
                         ("tape, num_groups=1", one_model), ("hooks", hook_model), ("optimizer", opt_model),
                         ("fit+hooks", fit_model)]}
for name, weights in paths.items():
    assert_close(weights, want_sgd, name)
    assert_close(weights, paths["tape"], f"{name} vs tape", rtol=1e-6, atol=1e-7)

adam_model, adam_opt = mlp(0), tfops.DistributedOptimizer(keras.optimizers.Adam(0.01))
for s in range(STEPS):
    with tf.GradientTape() as tape:
        loss = LOSS(y_mine[s], adam_model(x_mine[s], training=True))
    adam_opt.apply(tape.gradient(loss, adam_model.trainable_variables), adam_model.trainable_variables)
assert_close(adam_model.trainable_variables, reference(keras.optimizers.Adam(0.01)), "Adam", rtol=1e-4, atol=1e-5)
assert int(adam_opt.iterations) == STEPS

# -- 3. sparse gradients (Embedding -> IndexedSlices) ------------------------------------------
TOKENS = rng.integers(0, 20, (STEPS, p, B, 3))


def embedder(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,), dtype="int64"), keras.layers.Embedding(20, 4),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])


def sparse_run(model, optimizer, global_batch: bool):
    for s in range(STEPS):
        xb = TOKENS[s].reshape(p * B, 3) if global_batch else TOKENS[s, me]
        yb = Y[s].reshape(p * B) if global_batch else Y[s, me]
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        optimizer.apply(grads, model.trainable_variables)
    return [v.numpy() for v in model.trainable_variables]


want = sparse_run(embedder(0), keras.optimizers.SGD(0.5), True)
for dense in (False, True):
    got = sparse_run(embedder(0), tfops.DistributedOptimizer(keras.optimizers.SGD(0.5), sparse_as_dense=dense), False)
    assert_close(got, want, f"embedding sparse_as_dense={dense}")
    assert_same_on_every_rank(got, f"embedding sparse_as_dense={dense}")


# An embedding under two dense layers, the tape's buckets in a tf.function (a bucket per gradient):
# the embedding's allgather is made after the buckets' submits, so the submits still come first in
# the graph (before, TF's program-order chain put it ahead of them and the submit-first edges closed
# a cycle: "678 nodes in a cycle" on examples/gpt.py at hidden 128).
def embedder2(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,), dtype="int64"), keras.layers.Embedding(20, 4),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(2)])


emb_model, emb_opt = embedder2(0), keras.optimizers.SGD(0.5)


@tf.function
def emb_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = LOSS(yb, emb_model(xb, training=True))
    grads = tfops.DistributedGradientTape(tape).gradient(loss, emb_model.trainable_variables)
    emb_opt.apply(grads, emb_model.trainable_variables)


overlap.BUCKET_BYTES, saved_bucket = 1, overlap.BUCKET_BYTES
try:
    graph = emb_step.get_concrete_function(tf.TensorSpec((B, 3), tf.int64), tf.TensorSpec((B,), tf.int64)).graph
finally:
    overlap.BUCKET_BYTES = saved_bucket
submits = {op for op in graph.get_operations() if op.name.startswith("tfops_grad_submit")}
waiting = [op for op in graph.get_operations() if op.type != "PyFunc" and submits & set(op.control_inputs)]
assert len(submits) == 4 and waiting, f"embedding: {len(submits)} bucket submits, {len(waiting)} ops after them"
for s in range(STEPS):
    emb_step(TOKENS[s, me], Y[s, me])
want = sparse_run(embedder2(0), keras.optimizers.SGD(0.5), True)
assert_close([v.numpy() for v in emb_model.trainable_variables], want, "embedding + dense, a bucket per gradient")

# -- 4. backward_passes_per_step ----------------------------------------------------------------
acc_model = mlp(0)
acc_opt = tfops.DistributedOptimizer(keras.optimizers.SGD(0.2), backward_passes_per_step=2,
                                     average_aggregated_gradients=True)
for s in range(4):
    with tf.GradientTape() as tape:
        loss = LOSS(y_mine[s], acc_model(x_mine[s], training=True))
    acc_opt.apply(tape.gradient(loss, acc_model.trainable_variables), acc_model.trainable_variables)
ref_model, ref_opt = mlp(0), keras.optimizers.SGD(0.2)
for s in (0, 2):                                   # one update per two micro-batches
    with tf.GradientTape() as tape:
        loss = LOSS(Y[s:s + 2].reshape(-1), ref_model(X[s:s + 2].reshape(-1, 5), training=True))
    ref_opt.apply(tape.gradient(loss, ref_model.trainable_variables), ref_model.trainable_variables)
assert_close(acc_model.trainable_variables, [v.numpy() for v in ref_model.trainable_variables], "bpps=2")
assert int(acc_opt.iterations) == 4                # Horovod's: iterations counts backward passes

# -- 5. the digits example ------------------------------------------------------------------------
args = keras_digits.parse_args(["--epochs", "8"])
distributed = keras_digits.train(args)
single = keras_digits.train(args, distributed=False)
assert abs(distributed - single) <= 0.01, f"digits: {p} ranks {distributed:.4f} vs one process {single:.4f}"
assert single > 0.9, single

# -- 6. examples/custom_loop.py, tape and hooks (each main() ends with shutdown; init restarts) ---
import custom_loop  # noqa: E402

with_tape = custom_loop.main(["--steps", "60"])
with_hooks = custom_loop.main(["--steps", "60", "--hooks"])
assert with_tape > 0.8 and abs(with_tape - with_hooks) <= 0.01, (with_tape, with_hooks)

hvd.shutdown()
print(f"rank {me}: tf_train OK (digits {distributed:.4f} vs {single:.4f})", flush=True)
