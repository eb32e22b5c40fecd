"""Rank script: examples/gpt.py's --pipeline on a 3D mesh (issue 43), against one process.

``mpirun -np 8 python pipeline_gpt_check.py`` (tensor 2 x data 2 x pipeline 2; -np 4 gives
tensor 2 x pipeline 2: ``pipeline_gpt_check.py 2 2``; -np 2 ``1 2``). Every rank builds the split
GPT from one seed and the plain-Keras GPT with the same full weights. The pipeline (m = 4) trains
Adam steps of the global batch of 16, each data rank on its half, while every rank trains the
plain model on the whole batch, its gradient made dense as the pipeline's is (Keras' Adam steps
differently on the embeddings' IndexedSlices: Pipeline._accumulate says why). The loss of every
step and every weight of this rank's stage, gathered over the tensor group, match within 1e-5.

FULL (by hand; eight TF ranks training two GPTs each cost minutes on the 2-core machine): 1f1b
(2 blocks), then interleaved (4 blocks, one a chunk, 2 chunks a rank), hidden 32, seq 16, 10 steps.
LEAN (``--lean``, run by tests/test_pipeline.py at -np 8): 1f1b, 2 blocks, hidden 16, 2 heads,
seq 8, 3 steps: the three axes together, in one launch; the schedules alone are checked by
pipeline_check.py.
Prints "rank R: pipeline_gpt_check OK".
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
import keras  # noqa: E402

import tfops  # noqa: E402
from tfops import parallel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import gpt  # noqa: E402
from gpt_pipeline import pipeline_of  # noqa: E402

BATCH, TOL = 16, 1e-5
FULL = dict(steps=10, hidden=32, heads=4, seq=16, schedules=("1f1b", "interleaved"))
LEAN = dict(steps=3, hidden=16, heads=2, seq=8, schedules=("1f1b",))


def gathered(layer):
    return layer.get_full_weights() if hasattr(layer, "get_full_weights") else layer.get_weights()


def check(mesh, schedule, *, steps, hidden, heads, seq):
    ids, vocab = gpt.text_and_vocab()
    layers = 4 if schedule == "interleaved" else 2        # interleaved: one block a chunk, 2 chunks a rank
    cfg = gpt.Config(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    model = gpt.build(cfg, mesh, seed=3)
    plain = gpt.build(cfg, plain=True, seed=3)
    gpt.load_full_weights(plain, gpt.full_weights(model))
    pipe = pipeline_of(model, mesh, micro_batches=4, schedule=schedule)
    opt, ref_opt = keras.optimizers.Adam(3e-3), keras.optimizers.Adam(3e-3)
    rows = BATCH // mesh.data
    for step in range(steps):
        x, y = gpt.batch(ids, step, BATCH, cfg.seq)
        mine = slice(mesh.data_rank * rows, (mesh.data_rank + 1) * rows)
        loss = float(pipe.train_step(x[mine], y[mine], opt))
        with tf.GradientTape() as tape:
            ref = plain.loss_of(plain(x), y)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(ref, plain.trainable_variables)]   # dense, as
        ref_opt.apply_gradients(zip(grads, plain.trainable_variables))      # the pipeline's (Pipeline._accumulate)
        assert abs(loss - float(ref)) <= TOL, f"{schedule} step {step}: loss {loss} vs one process {float(ref)}"
    worst, plain_layers, split_layers = 0.0, plain.layer_list(), model.layer_list()
    for stage in pipe.chunks:                             # every layer of this rank's chunks, gathered
        for layer in stage.layer_list():
            j = next(i for i, s in enumerate(split_layers) if s is layer)
            for a, b in zip(gathered(layer), plain_layers[j].get_weights()):
                worst = max(worst, float(np.abs(a - b).max()))
    assert worst <= TOL, f"{schedule}: stage weights differ from one process by {worst}"
    print(f"rank {tfops.rank()}: gpt {schedule} on {mesh}: {steps} steps equal one process "
          f"(weights within {worst:.1e})", flush=True)


def run(mesh, *, steps, hidden, heads, seq, schedules) -> None:
    for schedule in schedules:
        check(mesh, schedule, steps=steps, hidden=hidden, heads=heads, seq=seq)


if __name__ == "__main__":
    tfops.init()                                      # argv: TENSOR PIPELINE (default 2 2) [--lean]
    sizes = [int(a) for a in sys.argv[1:3] if a.isdigit()] or [2, 2]
    run(parallel.Mesh(tensor=sizes[0], pipeline=sizes[1]), **(LEAN if "--lean" in sys.argv else FULL))
    print(f"rank {tfops.rank()}: pipeline_gpt_check OK", flush=True)
