"""Rank script: tfops.parallel's tensor parallelism (issue 42) against plain Keras, at -np 2 or 4.

``mpirun -np P python tensor_check.py``, run by tests/test_parallel_tensor.py. Meshes: tensor 2
at P = 2; tensor 4, then tensor 2 x data 2, in the same launch at P = 4. For each mesh:

1. Region operators, eagerly and in a tf.function: forward and the gradient of sum(y * r)
   against numpy (allreduce, slice, allgather, reduce-scatter as the module's table says).
2. Each layer alone against the plain Keras layer loaded with the same full weights (Dense,
   Embedding with a vocabulary the tensor size does not divide, MultiHeadAttention causal), with
   and without sequence parallelism, eager and tf.function: output, gradient with respect to the
   input, and the full weights' gradients, within 1e-5 relative; plus the loss
   (vocab_parallel_cross_entropy against Keras's sparse cross-entropy, with its logits gradient).
3. init="per_rank": the full kernel's Glorot range and variance, a different slice per tensor rank, the
   same on every data rank. model.fit of Column -> Row against the plain Dense -> Dense model on the
   global batch; with a data axis through tfops.keras.DistributedOptimizer(process_set=mesh.data_set),
   after BroadcastGlobalVariablesCallback(process_set=mesh.data_set) repairs a spoiled data replica.
4. examples/gpt.py, 20 Adam steps (GPT_STEPS, the issue's count), data split over the mesh's data axis
   (DistributedGradientTape(process_set=mesh.data_set)), with and without sequence parallelism:
   the loss of every step and the full weights at the end equal the plain single-process model's
   on the global batch within 1e-5 relative; replicated weights bitwise equal in a tensor group.
   (Weights: 1e-4 relative, see check_gpt; the key bias, whose true gradient is 0, absolutely.)
   Tensor 2 x data 2 included: its gradients are dense (gpt.train_step_fn says why).
5. Collectives of one training step, counted as they run: 4 L + 5 allreduces (2 per block forward,
   2 backward, the embedding's, the head's input gradient, the loss's 3) without sequence
   parallelism; with it 4 L + 2 allgathers, 4 L + 2 reduce-scatters and 4 allreduces (the loss's
   3 and one for the replicated weights' gradients).
6. Memory: the bytes of the split weights, their gradients and Adam's two slots on each rank are
   exactly 1/tensor of the plain model's for the same layers.
7. Bad input raises on every rank: units and heads not divisible (ShapeError), a mesh that does
   not divide the world (MeshError), one rank of a tensor group building a different layer
   (MismatchError), set_full_weights with a wrong shape on one rank only (ShapeError everywhere).
8. A checkpoint (the full weights, np.savez) saved at one tensor size loads at another: saved from
   the trained tensor-4 GPT, loaded at tensor 2 (x data 2) and into the plain model; saved from tensor
   2 at P = 2, loaded into the plain model. The loaded models' loss on a fresh batch equals the
   saving model's within 1e-5.
Prints "rank R: tensor_check OK" at the end; rank 0 prints each phase's seconds.
"""
import os
import sys
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import tfops  # noqa: E402
import tfops.keras as hvd_keras  # noqa: E402
from tfops import parallel  # noqa: E402
from tfops.parallel import regions  # noqa: E402
import gpt  # noqa: E402

tfops.init()
P, ME = tfops.size(), tfops.rank()
TOL = 1e-5


def close(got, want, what, tol=TOL, floor=1e-30):
    """Relative error within ``tol``; ``floor``: the smallest norm to divide by (a gradient that is zero
    in exact arithmetic, as a key projection's bias is under softmax, is rounding noise in both runs)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"rank {ME}: {what}: shape {got.shape} != {want.shape}"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), floor)
    assert err <= tol, f"rank {ME}: {what}: relative error {err:.3g} > {tol:g}"


def part(full, axis, mesh):
    return np.split(np.asarray(full), mesh.tensor, axis=axis)[mesh.tensor_rank]


def weights_r(shape):
    """The fixed upstream gradient r of L = sum(y * r) for an output of ``shape``."""
    return np.cos(np.arange(int(np.prod(shape))).reshape(shape) * 0.37).astype(np.float32)


def grads_of(fn, x, variables=(), r=None):
    """y, dL/dx, dL/dvariables for L = sum(y * r) (default r: weights_r of y's shape)."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
        loss = tf.reduce_sum(y * (weights_r(y.shape) if r is None else r))
    out = tape.gradient(loss, [x] + list(variables))
    return y, out[0], out[1:]


# --------------------------------------------------------------------------- 1. regions
def check_regions(mesh):
    t, k = mesh.tensor, mesh.tensor_rank
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((2, 4 * t, 3 * t)).astype(np.float32) for _ in range(t)]   # one per tensor rank
    x = xs[k]
    r = weights_r
    total = sum(xs)
    cases = {   # op: (forward want, backward want given r of the output's shape and every rank's r)
        "copy": (regions.copy_to_tensor_region, x, lambda: t * r(x.shape)),
        "reduce": (regions.reduce_from_tensor_region, total, lambda: r(x.shape)),
        "scatter": (regions.scatter_to_tensor_region, part(x, -1, mesh),
                    lambda: np.concatenate([r(part(x, -1, mesh).shape)] * t, -1)),
        "gather": (regions.gather_from_tensor_region, np.concatenate(xs, -1),
                   lambda: part(r((2, 4 * t, 3 * t * t)), -1, mesh)),
        "seq_gather": (regions.gather_from_sequence_region, np.concatenate(xs, 1),
                       lambda: t * part(r((2, 4 * t * t, 3 * t)), 1, mesh)),
        "seq_reduce_scatter": (regions.reduce_scatter_to_sequence_region, part(total, 1, mesh),
                               lambda: np.concatenate([r(part(x, 1, mesh).shape)] * t, 1)),
        "seq_scatter": (regions.scatter_to_sequence_region, part(x, 1, mesh),
                        lambda: np.concatenate([r(part(x, 1, mesh).shape)] * t, 1)),
    }
    for name, (op, want, want_grad) in cases.items():
        for mode, fn in (("eager", lambda z, op=op: op(z, mesh)), ("tf.function", tf.function(lambda z, op=op: op(z, mesh)))):
            y, dx, _ = grads_of(fn, x)
            close(y, want, f"{name} forward ({mode})")
            close(dx, want_grad(), f"{name} backward ({mode})")


# --------------------------------------------------------------------------- 2. layers
def compare_layer(name, plain, split, x_full, x_mine, mine_out, mine_in, mesh, call_plain=None, call_split=None):
    """The split layer on this rank's input against the plain layer on the full input: output, input
    gradient (this rank's part of each, as ``mine_out`` / ``mine_in`` take it) and every full weight's
    gradient (gathered like the weight), eagerly and in a tf.function."""
    call_plain = call_plain or plain
    call_split = call_split or split
    y0, dx0, dw0 = grads_of(call_plain, x_full, plain.trainable_weights)
    r_mine = mine_out(weights_r(y0.shape))          # my part of the plain run's upstream gradient
    for mode, fn in (("eager", call_split), ("tf.function", tf.function(call_split))):
        y, dx, dw = grads_of(fn, x_mine, split.trainable_weights, r=r_mine)
        close(y, mine_out(y0.numpy()), f"{name} output ({mode})")
        if x_full.dtype.kind == "f":
            close(dx, mine_in(dx0.numpy()), f"{name} input grad ({mode})")
        grads = {id(v): g for v, g in zip(split.trainable_weights, dw)}
        sp_ids = {id(v) for v in split.sequence_parallel_weights}
        scale = 1e-2 * max(float(tf.norm(tf.convert_to_tensor(w))) for w in dw0)   # of the largest weight gradient
        for i, ((var, axis, shape, pad), want) in enumerate(zip(split._parts, dw0)):
            g = tf.convert_to_tensor(grads[id(var)])
            if id(var) in sp_ids:
                g = parallel.allreduce_sequence_parallel_gradients([g], [var], [var], mesh)[0]
            full = parallel.init.gather_full(g.numpy(), axis, mesh)
            close(full[:shape[0]] if pad else full, tf.convert_to_tensor(want), f"{name} weight {i} grad ({mode})",
                  floor=scale)


def check_layers(mesh, sp):
    t = mesh.tensor
    rng = np.random.default_rng(11)
    b, s, h = 2, 4 * t, 8 * t
    x = rng.standard_normal((b, s, h)).astype(np.float32)
    mine_seq = (lambda a: part(a, 1, mesh)) if sp else (lambda a: a)
    x_in = mine_seq(x)
    tag = f"tensor {t} sp={sp}"
    # Column (each rank: its units) and Column gather_output (all units)
    for gather in (False, True):
        keras.utils.set_random_seed(1)
        plain = keras.layers.Dense(6 * t, activation="tanh")
        plain(x)
        keras.utils.set_random_seed(1)       # the same seed: the split layer draws the same full kernel
        split = parallel.ColumnParallelDense(6 * t, mesh, activation="tanh", gather_output=gather,
                                             sequence_parallel=sp)
        split(x_in)
        assert all(np.array_equal(a, b_) for a, b_ in zip(split.get_full_weights(), plain.get_weights())), \
            f"rank {ME}: sliced init differs from keras.layers.Dense's draw"
        mine = (lambda a: a) if gather else (lambda a: part(a, -1, mesh))
        compare_layer(f"Column gather={gather} {tag}", plain, split, x, x_in, mine, mine_seq, mesh)
    # Row, input already split or not
    for split_in in (True, False):
        keras.utils.set_random_seed(2)
        plain = keras.layers.Dense(5)
        plain(x)
        split = parallel.RowParallelDense(5, mesh, input_is_parallel=split_in, sequence_parallel=sp)
        x_row = part(x, -1, mesh) if split_in else x
        split(x_row)
        split.set_full_weights(plain.get_weights())
        compare_layer(f"Row input_is_parallel={split_in} {tag}", plain, split, x, x_row, mine_seq,
                      (lambda a: part(a, -1, mesh)) if split_in else (lambda a: a), mesh)
    # Embedding: a vocabulary the tensor size does not divide
    ids = rng.integers(0, 4 * t + 1, (b, s)).astype(np.int32)
    keras.utils.set_random_seed(3)
    plain = keras.layers.Embedding(4 * t + 1, h)
    plain(ids)
    keras.utils.set_random_seed(3)
    split = parallel.VocabParallelEmbedding(4 * t + 1, h, mesh, sequence_parallel=sp)
    split(ids)
    assert all(np.array_equal(a, b_) for a, b_ in zip(split.get_full_weights(), plain.get_weights())), \
        f"rank {ME}: sliced init differs from keras.layers.Embedding's draw"
    compare_layer(f"Embedding {tag}", plain, split, ids, ids, mine_seq, None, mesh)
    # Attention, causal, self-attention
    keras.utils.set_random_seed(4)
    plain = keras.layers.MultiHeadAttention(2 * t, 4)
    plain(x, x)
    split = parallel.ParallelMultiHeadAttention(2 * t, 4, mesh, causal=True, sequence_parallel=sp)
    split(x_in, x_in)
    split.set_full_weights(plain.get_weights())
    compare_layer(f"Attention {tag}", plain, split, x, x_in, mine_seq, mine_seq, mesh,
                  call_plain=lambda z: plain(z, z, use_causal_mask=True), call_split=lambda z: split(z, z))
    # the loss: logits split by vocabulary
    logits = rng.standard_normal((b, s, 8 * t)).astype(np.float32) * 3
    labels = rng.integers(0, 8 * t, (b, s))
    with tf.GradientTape() as tape:
        z = tf.constant(logits)
        tape.watch(z)
        want = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(labels, z, from_logits=True))
    dz = tape.gradient(want, z).numpy()
    for mode, fn in (("eager", parallel.vocab_parallel_cross_entropy),
                     ("tf.function", tf.function(parallel.vocab_parallel_cross_entropy))):
        with tf.GradientTape() as tape:
            mine = tf.constant(part(logits, -1, mesh))
            tape.watch(mine)
            got = tf.reduce_sum(fn(mine, labels, mesh))
        close(got, want, f"vocab_parallel_cross_entropy ({mode}) {tag}")
        close(tape.gradient(got, mine), part(dz, -1, mesh), f"cross-entropy logits grad ({mode}) {tag}")


def check_per_rank_init(mesh):
    """init="per_rank": each tensor rank draws only its slice, from the full kernel's Glorot range and
    variance, a different draw per tensor rank, the same on every data rank."""
    t = mesh.tensor
    keras.utils.set_random_seed(9)
    layer = parallel.ColumnParallelDense(64 * t, mesh, init="per_rank")
    layer(np.zeros((1, 256), np.float32))
    mine, full = layer.kernel.numpy(), layer.get_full_weights()[0]
    limit = np.sqrt(6 / (256 + 64 * t))                          # the full (256, 64 t) kernel's Glorot limit
    assert np.abs(mine).max() <= limit and abs(mine.std() / (limit / np.sqrt(3)) - 1) < 0.05, \
        f"rank {ME}: per-rank init: max {np.abs(mine).max():.4f}, std {mine.std():.4f}, limit {limit:.4f}"
    parts = np.split(full, t, axis=1)
    assert not any(np.array_equal(parts[0], q) for q in parts[1:]), f"rank {ME}: per-rank slices repeat"
    if mesh.data > 1:
        copies = tfops.allgather(tf.constant(mine[None]), process_set=mesh.data_set).numpy()
        assert all(np.array_equal(copies[0], c) for c in copies), f"rank {ME}: data ranks drew different slices"


# --------------------------------------------------------------------------- 3. model.fit
def check_fit(mesh):
    """Column -> Row in model.fit against Dense -> Dense on the global batch. With a data axis: each
    data rank fits its rows through tfops.keras.DistributedOptimizer(process_set=mesh.data_set), and
    BroadcastGlobalVariablesCallback(process_set=mesh.data_set) first repairs data rank 1's spoiled copy."""
    t, D = mesh.tensor, mesh.data
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16 * D, 6)).astype(np.float32)
    y = rng.standard_normal((16 * D, 3)).astype(np.float32)
    rows = np.concatenate([np.arange(b * 8 * D + 8 * mesh.data_rank, b * 8 * D + 8 * (mesh.data_rank + 1))
                           for b in range(2)])                 # my 8 rows of each global batch of 8 D
    models = []
    for split in (False, True):
        keras.utils.set_random_seed(6)
        inp = keras.Input((6,))
        if split:
            h = parallel.ColumnParallelDense(4 * t, mesh, activation="relu")(inp)
            out = parallel.RowParallelDense(3, mesh)(h)
        else:
            out = keras.layers.Dense(3)(keras.layers.Dense(4 * t, activation="relu")(inp))
        model = keras.Model(inp, out)
        opt = keras.optimizers.SGD(0.1)
        if split and D > 1:
            opt = hvd_keras.DistributedOptimizer(opt, process_set=mesh.data_set)
        model.compile(optimizer=opt, loss="mse")
        models.append(model)
    plain, split = models
    for layer_p, layer_s in zip(plain.layers[1:], split.layers[1:]):
        layer_s.set_full_weights(layer_p.get_weights())
    callbacks = []
    if D > 1:
        if mesh.data_rank == 1:                                   # spoil this copy: the broadcast repairs it
            for v in split.trainable_weights:
                v.assign(v * 0 + 9.0)
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(
            root_rank=mesh.rank_of(data_rank=0), process_set=mesh.data_set)]
    plain.fit(x, y, batch_size=8 * D, epochs=2, shuffle=False, verbose=0)
    split.fit(x[rows], y[rows], batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    for layer_p, layer_s in zip(plain.layers[1:], split.layers[1:]):
        for i, (a, b) in enumerate(zip(layer_s.get_full_weights(), layer_p.get_weights())):
            close(a, b, f"model.fit tensor {t} data {D}: {layer_s.name} weight {i}")


# --------------------------------------------------------------------------- 4-6. the GPT example
def gpt_config(mesh, sp=False):
    return gpt.Config(layers=2, hidden=16 * mesh.tensor, heads=2 * mesh.tensor, seq=8 * mesh.tensor,
                      vocab=gpt.text_and_vocab()[1], sequence_parallel=sp)


GPT_STEPS = 20


def plain_reference(mesh, steps=GPT_STEPS) -> dict:
    """The plain single-process GPT on the global batches, trained once by rank 0 for every rank and
    both sequence-parallel cases (it does not depend on them): its initial full weights, the loss of
    every step and the full weights at the end. One run instead of one per rank and case: at -np 4 on
    2 cores the reference's tracing and steps were about half of this check's time."""
    ref = None
    if ME == 0:
        cfg = gpt_config(mesh)
        ids = gpt.text_and_vocab()[0]
        plain = gpt.build(cfg, plain=True, seed=1)
        ref = {"init": gpt.full_weights(plain), "losses": []}
        step = gpt.train_step_fn(plain, keras.optimizers.Adam(3e-3), mesh)
        for i in range(steps):
            ref["losses"].append(float(step(*gpt.batch(ids, i, 4 * mesh.data, cfg.seq))))
        ref["final"] = gpt.full_weights(plain)
    return tfops.broadcast_object(ref)


def check_gpt(mesh, sp, ref, steps=GPT_STEPS):
    """Returns the trained split model and its config (for the checkpoint check)."""
    ids = gpt.text_and_vocab()[0]
    cfg = gpt_config(mesh, sp)
    tag = f"gpt tensor {mesh.tensor} data {mesh.data} sp={sp}"
    split = gpt.build(cfg, mesh, seed=2)
    gpt.load_full_weights(split, ref["init"])
    opt_s = keras.optimizers.Adam(3e-3)
    step_s = gpt.train_step_fn(split, opt_s, mesh, mesh.data_set if mesh.data > 1 else None)
    rows = 4 * mesh.data
    losses = ref["losses"]
    for i in range(steps):
        x, y = gpt.batch(ids, i, rows, cfg.seq)
        mine = slice(4 * mesh.data_rank, 4 * mesh.data_rank + 4)
        if i == 1:
            regions.reset_counts()
        got = step_s(x[mine], y[mine])
        if i == 1:
            counts = regions.collective_counts()
        if mesh.data > 1:
            got = tfops.allreduce(got, process_set=mesh.data_set)
        close(got, losses[i], f"{tag} loss of step {i}")
    for i, (layer, a, b) in enumerate(zip(split.layer_list(), gpt.full_weights(split), ref["final"])):
        for j, (u, v) in enumerate(zip(a, b)):
            if isinstance(layer, parallel.ParallelMultiHeadAttention) and j == 3:
                # the key bias: its true gradient is 0 (q.(k + b) shifts every score of a query alike, and
                # softmax ignores that), so both models step it by Adam on rounding noise (|g| ~ 1e-9 <<
                # epsilon 1e-7: steps of ~lr/100). Relative equality is meaningless there; bound it absolutely.
                assert np.abs(u - v).max() < steps * 3e-3 / 10, f"{tag}: key bias moved apart"
                continue
            # 1e-4, not 1e-5: Adam divides each gradient by its own running RMS, so float32 rounding in an
            # element whose gradient is near 0 comes out at full step size (tensor 4: the row bias, 2.3e-5)
            close(u, v, f"{tag}: layer {i} weight {j} after {steps} Adam steps", 1e-4)
    assert losses[-1] < losses[0], f"{tag}: loss did not go down: {losses}"
    # replicated weights are bitwise equal across the tensor group
    for layer in split.layer_list():
        parts = getattr(layer, "_parts", None)
        replicated = [var for var, axis, _, _ in parts if axis is None] if parts else layer.weights
        for var in replicated:
            every = parallel.init.gather_full(var.numpy()[None], 0, mesh)
            assert all(np.array_equal(every[0], e) for e in every), f"rank {ME}: {tag}: {var.path} differs"
    # 5. the collectives of one step (step 1: traced already), as they ran
    L = cfg.layers
    want = {"allreduce": 4 * L + 5} if not sp else \
        {"allgather": 4 * L + 2, "reducescatter": 4 * L + 2, "allreduce": 4}
    assert counts == want, f"rank {ME}: {tag}: collectives of one step {counts}, expected {want}"
    # 6. memory: split weights, gradients (same shapes) and Adam's two slots are 1/tensor of the plain model's
    split_vars = [var for layer in split.layer_list() for var, axis, _, _ in getattr(layer, "_parts", []) if axis is not None]
    full_bytes = 0
    for layer, full in zip(split.layer_list(), ref["init"]):      # the plain model's weights, layer by layer
        for (var, axis, shape, pad), w in zip(getattr(layer, "_parts", []), full):
            if axis is not None:
                full_bytes += w.nbytes
    mine_bytes = sum(v.numpy().nbytes for v in split_vars)
    slots = sum(opt_s._momentums[opt_s._get_variable_index(v)].numpy().nbytes
                + opt_s._velocities[opt_s._get_variable_index(v)].numpy().nbytes for v in split_vars)
    assert mine_bytes * mesh.tensor == full_bytes, f"{tag}: split weights {mine_bytes} B x {mesh.tensor} != {full_bytes}"
    assert slots == 2 * mine_bytes, f"{tag}: Adam slots {slots} B != 2 x {mine_bytes}"
    if ME == 0:
        print(f"{tag}: {steps} steps equal; loss {losses[0]:.3f} -> {losses[-1]:.3f}; one step ran {counts}; "
              f"split weights {mine_bytes} B/rank = 1/{mesh.tensor} of {full_bytes} B, Adam slots {slots} B",
              flush=True)
    return split, cfg


# --------------------------------------------------------------------------- 8. checkpoints across tensor sizes
CHECK_BATCH = 99        # a batch no training step used


def gpt_loss(model, cfg):
    x, y = gpt.batch(gpt.text_and_vocab()[0], CHECK_BATCH, 4, cfg.seq)
    return float(model.loss_of(model(x), y))


def save_checkpoint(model, cfg) -> tuple:
    """Rank 0 writes ``model``'s full weights (np.savez, one array per weight in layer order) to a
    file every rank can read; returns its path, the model's loss on CHECK_BATCH and ``cfg``."""
    loss = gpt_loss(model, cfg)
    path = tfops.broadcast_object(os.path.join(tempfile.mkdtemp(), "gpt.npz") if ME == 0 else None)
    full = gpt.full_weights(model)
    if ME == 0:
        np.savez(path, **{f"{i}.{j}": w for i, ws in enumerate(full) for j, w in enumerate(ws)})
    tfops.allgather_object(0)                                   # the file is written before anyone reads
    return path, loss, cfg


def check_checkpoint(path: str, want: float, cfg, mesh) -> None:
    """The checkpoint loaded into the split model at ``mesh`` (None: only the plain model) gives ``want``."""
    with np.load(path) as f:
        count = {}
        for key in f.files:
            i, j = map(int, key.split("."))
            count[i] = max(count.get(i, 0), j + 1)
        full = [[f[f"{i}.{j}"] for j in range(count.get(i, 0))] for i in range(len(count))]
    models = {"plain": gpt.build(cfg, plain=True, seed=5)}        # seed 5: other weights until loaded
    if mesh is not None:
        models[f"tensor {mesh.tensor} x data {mesh.data}"] = gpt.build(cfg, mesh, seed=5)
    for what, model in models.items():
        gpt.load_full_weights(model, full)
        close(gpt_loss(model, cfg), want, f"checkpoint loaded into the {what} model: loss")
    tfops.allgather_object(0)                                   # every rank has read it
    if ME == 0:
        shutil.rmtree(os.path.dirname(path))


# --------------------------------------------------------------------------- 7. bad input
def expect(error, fn, what):
    try:
        fn()
    except error as exc:
        assert str(exc), what
        return str(exc)
    raise AssertionError(f"rank {ME}: {what}: no {error.__name__}")


def check_bad_input(mesh):
    t = mesh.tensor
    expect(parallel.ShapeError, lambda: parallel.ColumnParallelDense(4 * t + 1, mesh), "units not divisible")
    expect(parallel.ShapeError, lambda: parallel.ParallelMultiHeadAttention(t + 1, 4, mesh), "heads not divisible")
    expect(parallel.MeshError, lambda: parallel.Mesh(tensor=3), "mesh not dividing the world")
    last = mesh.tensor_rank == t - 1
    layer = parallel.ColumnParallelDense(2 * t, mesh)
    msg = expect(parallel.MismatchError, lambda: layer(np.zeros((1, 5 if last else 4), np.float32)),
                 "different layer shapes in one tensor group")
    assert "tensor rank" in msg, msg
    layer = parallel.RowParallelDense(3, mesh)
    layer(np.zeros((1, 2), np.float32))
    weights = [np.zeros((2 * t, 3)), np.zeros((4 if last else 3,))]
    msg = expect(parallel.ShapeError, lambda: layer.set_full_weights(weights), "wrong full shapes on one rank")
    assert f"tensor rank {t - 1}: weight 1 has shape (4,)" in msg, msg


# --------------------------------------------------------------------------- run
class Phases:
    """Seconds of each phase, printed by rank 0 (the suite's time budget is tight)."""

    def __init__(self):
        self.last, self.seen = time.perf_counter(), []

    def done(self, what):
        now = time.perf_counter()
        self.seen.append(f"{what} {now - self.last:.1f}")
        self.last = now


meshes = [parallel.Mesh(tensor=2)] if P == 2 else [parallel.Mesh(tensor=4), parallel.Mesh(tensor=2)]
saved = None
for mesh in meshes:
    phases = Phases()
    check_regions(mesh)
    phases.done("regions")
    for sp in (False, True) if mesh is meshes[0] else (False,):   # -np 4's second mesh: sequence parallel in gpt only
        check_layers(mesh, sp)
    phases.done("layers")
    check_per_rank_init(mesh)
    check_fit(mesh)
    check_bad_input(mesh)
    phases.done("init, fit, bad input")
    ref = plain_reference(mesh)
    trained = [check_gpt(mesh, sp, ref) for sp in (False, True)]
    phases.done("gpt")
    if saved is not None:                    # -np 4: tensor 4's checkpoint into tensor 2 x data 2 and plain
        check_checkpoint(*saved, mesh)
    else:
        saved = save_checkpoint(*trained[0])
        if P == 2:                           # -np 2: tensor 2's checkpoint into the plain model
            check_checkpoint(*saved, None)
    phases.done("checkpoint")
    if ME == 0:
        print(f"{mesh}: regions, layers, per-rank init, model.fit, bad input, gpt, counts, memory, checkpoint: OK "
              f"(seconds: {', '.join(phases.seen)})", flush=True)
print(f"rank {ME}: tensor_check OK", flush=True)
