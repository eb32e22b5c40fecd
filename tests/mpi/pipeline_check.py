"""Rank script: tfops.parallel.Pipeline (issue 43) against the one-process model, at any world size.

``mpirun -np P python pipeline_check.py DIR``, run by tests/test_pipeline.py at P = 2 and 4, with
``Mesh(pipeline=P)``. The model: 8 Dense layers (5 -> 6 x 7 -> 3, tanh), cut into P chunks (P * 2
for interleaved), each rank building only its own; every rank also trains the whole model on one
process as the reference, from the same seeded weights and batches. Checks:

1. For each schedule (gpipe, 1f1b, interleaved with 2 chunks a rank) x m in {1, 4, 8} (interleaved:
   4 and 8, the multiples of P) x {SGD, Adam} (CASES): 10 steps of a batch of 8; the loss of every step, on every
   rank, and every chunk's weights after them equal the reference's within 1e-5; each micro-batch
   was forwarded and backwarded once per chunk (Pipeline.events).
2. Bad input raises MismatchError on every rank, and the pipeline then still trains: the last
   stage declares Input((7,)) while the one before sends 6 features; the first stage sends float16
   into a float32 Input; a batch that m does not divide.
3. model.fit of a PipelineModel (1f1b, m = 4, SGD, 2 epochs of 4 batches, shuffle=False) equals the
   reference model.fit's History and weights within 1e-5.
4. The timeline (tfops.start_timeline) holds a FORWARD and a BACKWARD span per micro-batch.
5. At P = 4 only: Mesh(pipeline=2) (data 2): 1f1b Adam, each data rank on half the batch, equals the
   reference. (examples/gpt.py's GPT with tensor x pipeline is tests/mpi/pipeline_gpt_check.py, run by
   hand: a third TF model in this launch took it past 600 s at load 55.)
Prints "rank R: pipeline_check OK" at the end.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import tfops  # noqa: E402
from tfops.parallel import Mesh  # noqa: E402
from tfops.parallel.pipeline import Pipeline  # noqa: E402
from tfops.parallel.pipeline_model import PipelineModel  # noqa: E402
from tfops.parallel.errors import MismatchError  # noqa: E402

tfops.init()
P, RANK = tfops.size(), tfops.rank()
OUT = sys.argv[1]
LAYERS, WIDTH, IN, OUTF, BATCH, STEPS, TOL = 8, 6, 5, 3, 8, 10, 1e-5
mesh = Mesh(pipeline=P)
rng = np.random.default_rng(43)
dims = [IN] + [WIDTH] * (LAYERS - 1) + [OUTF]
WEIGHTS = [(rng.standard_normal((dims[j], dims[j + 1])).astype(np.float32) * 0.6,
            rng.standard_normal(dims[j + 1]).astype(np.float32) * 0.1) for j in range(LAYERS)]
BATCHES = [(rng.standard_normal((BATCH, IN)).astype(np.float32), rng.standard_normal((BATCH, OUTF)).astype(np.float32))
           for _ in range(STEPS)]


def dense(j, dtype="float32"):
    return keras.layers.Dense(dims[j + 1], activation=None if j == LAYERS - 1 else "tanh", dtype=dtype)


def model_of(first, stop, *, in_shape=None, last_dtype="float32"):
    layers = [dense(j, last_dtype if j == stop - 1 else "float32") for j in range(first, stop)]
    model = keras.Sequential([keras.Input((in_shape or dims[first],))] + layers)
    if in_shape is None:                                 # a wrong Input on purpose: weights left random
        model.set_weights([w for j in range(first, stop) for w in WEIGHTS[j]])
    return model


def chunks_of(v, **kw):
    per = LAYERS // (P * v)
    return [model_of((c * P + RANK) * per, (c * P + RANK + 1) * per, **kw) for c in range(v)]


def optimizer(name):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def reference(name):
    """The whole model on one process, full batch: (losses per step, weights per layer)."""
    model, opt, losses = model_of(0, LAYERS), optimizer(name), []
    for x, y in BATCHES:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x, training=True)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def check_equal(schedule, m, name, ref, *, steps=STEPS):
    """Train ``steps`` steps; every loss equal to the reference's, and (all STEPS run) the weights too."""
    v = 2 if schedule == "interleaved" else 1
    chunks = chunks_of(v)
    pipe = Pipeline(chunks if v > 1 else chunks[0], mesh, m, schedule, loss="mse")
    opt = optimizer(name)
    for step, (x, y) in enumerate(BATCHES[:steps]):
        loss = float(pipe.train_step(x, y, opt))
        assert abs(loss - ref[0][step]) <= TOL, f"{schedule} m={m} {name} step {step}: loss {loss} vs {ref[0][step]}"
    if steps < STEPS:
        return 0.0
    per = LAYERS // (P * v)
    for c, chunk in enumerate(chunks):
        k = c * P + RANK
        want = ref[1][2 * k * per: 2 * (k + 1) * per]
        err = max(float(np.abs(a - b).max()) for a, b in zip(chunk.get_weights(), want))
        assert err <= TOL, f"{schedule} m={m} {name}: model chunk {k}'s weights differ by {err}"
    done = sorted((kind, i, c) for kind, i, c, _, _ in pipe.events if kind in "FB")
    assert done == sorted((kind, i, c) for kind in "FB" for i in range(m) for c in range(v)), done
    return err


def expect_mismatch(what, build, x, y, m=4):
    try:
        Pipeline(build(), mesh, m, "1f1b", loss="mse").train_step(x, y, keras.optimizers.SGD(0.1))
    except MismatchError as exc:
        assert what in str(exc), f"expected {what!r} in: {exc}"
        return
    raise AssertionError(f"rank {RANK}: no MismatchError for {what}")


# Each schedule at each m (interleaved: the multiples of P), with each optimizer.
CASES = {"gpipe": [(m, n) for m in (1, 4, 8) for n in ("sgd", "adam")],
         "1f1b": [(m, n) for m in (1, 4, 8) for n in ("sgd", "adam")],
         "interleaved": [(m, n) for m in (4, 8) for n in ("sgd", "adam")]}      # m a multiple of P (P = 2 or 4)
refs = {name: reference(name) for name in ("sgd", "adam")}
worst = 0.0
for schedule, cases in CASES.items():
    for m, name in cases:
        worst = max(worst, check_equal(schedule, m, name, refs[name]))
print(f"rank {RANK}: equal to one process, every schedule, worst weight difference {worst:.2e}", flush=True)

x, y = BATCHES[0]
expect_mismatch("expects shape", lambda: model_of(LAYERS - LAYERS // P, LAYERS, in_shape=7) if RANK == P - 1
                else chunks_of(1)[0], x, y)
expect_mismatch("expects dtype float32", lambda: model_of(0, LAYERS // P, last_dtype="float16") if RANK == 0
                else chunks_of(1)[0], x, y)
expect_mismatch("does not divide into 4", lambda: chunks_of(1)[0], x[:6], y[:6])
check_equal("1f1b", 4, "sgd", refs["sgd"])              # nothing left over on the wire: it still trains
print(f"rank {RANK}: bad shapes, dtypes and batches raise MismatchError on every rank", flush=True)

xs, ys = np.concatenate([b[0] for b in BATCHES[:4]]), np.concatenate([b[1] for b in BATCHES[:4]])
ref_model = model_of(0, LAYERS)
ref_model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
ref_hist = ref_model.fit(xs, ys, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history["loss"]
model = PipelineModel(Pipeline(chunks_of(1)[0], mesh, 4, "1f1b", loss="mse"))
model.compile(optimizer=keras.optimizers.SGD(0.1))
hist = model.fit(xs, ys, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history["loss"]
assert np.allclose(hist, ref_hist, atol=TOL, rtol=0), (hist, ref_hist)
per = LAYERS // P
err = max(float(np.abs(a - b).max()) for a, b in zip(model.pipeline.chunks[0].get_weights(),
                                                    ref_model.get_weights()[2 * RANK * per: 2 * (RANK + 1) * per]))
assert err <= TOL, f"fit: weights differ by {err}"
print(f"rank {RANK}: model.fit equals the one-process fit (loss {hist[-1]:.6f})", flush=True)

path = os.path.join(OUT, "tl.json")
tfops.start_timeline(path)
pipe = Pipeline(chunks_of(1)[0], mesh, 4, "gpipe", loss="mse")
pipe.train_step(x, y, keras.optimizers.SGD(0.1))
tfops.stop_timeline()
mine = path if RANK == 0 else os.path.join(OUT, f"tl.rank{RANK}.json")
events = [json.loads(line.rstrip(",\n")) for line in open(mine) if line.startswith("{")]
spans = sorted((e["name"], e["args"]["micro_batch"]) for e in events if e.get("name") in ("FORWARD", "BACKWARD"))
assert spans == sorted((n, i) for n in ("FORWARD", "BACKWARD") for i in range(4)), spans
if P == 4:                                             # data x pipeline: 2 stages, each batch split in two
    mesh2, half, rows = Mesh(pipeline=2), LAYERS // 2, BATCH // 2
    r = mesh2.pipeline_rank
    stage = model_of(r * half, (r + 1) * half)
    pipe, opt = Pipeline(stage, mesh2, 4, "1f1b", loss="mse"), optimizer("adam")
    for step, (x, y) in enumerate(BATCHES):
        mine = slice(mesh2.data_rank * rows, (mesh2.data_rank + 1) * rows)
        loss = float(pipe.train_step(x[mine], y[mine], opt))
        want = refs["adam"][0][step]
        assert abs(loss - want) <= TOL, f"data x pipeline step {step}: {loss} vs {want}"
    want = refs["adam"][1][2 * r * half:2 * (r + 1) * half]
    err = max(float(np.abs(a - b).max()) for a, b in zip(stage.get_weights(), want))
    assert err <= TOL, f"data x pipeline: weights differ by {err}"
    print(f"rank {RANK}: {mesh2}: equal to one process (weights within {err:.1e})", flush=True)
print(f"rank {RANK}: pipeline_check OK", flush=True)
