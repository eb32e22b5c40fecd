"""Lesson 15: one LARS step on the lab's model, layer by layer (tfops.optimizers.LARS).

    python docs/examples/trust_ratio.py [--lr 2.0] [--eta 0.001] [--clip]

Takes the gradient of one batch of 256 digits at the lab's initial weights, applies one
LARS step (no momentum, no weight decay) and prints, per variable, the norms, the trust
ratio eta*||w||/||g||, and how far the step moved the variable relative to its size.
Every adapted kernel moves by the same fraction, lr * eta, whatever its gradient's size;
the biases (rank 1, excluded) take a plain SGD step at lr.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfops.optimizers import LARS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import digits  # noqa: E402   (examples/digits.py: the data, shipped with the project)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--eta", type=float, default=0.001)
    parser.add_argument("--clip", action="store_true", help="LARC clipping: rate min(trust, lr)")
    args = parser.parse_args(argv)
    data, target = digits.load()
    x, y = (data[:256] / 16.0).astype("float32"), target[:256]
    keras.utils.set_random_seed(0)
    # the lab's model; names fixed so that a second run in one process prints the same ones
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu", name="dense"),
                              keras.layers.Dense(64, activation="relu", name="dense_1"),
                              keras.layers.Dense(10, name="dense_2")], name="sequential")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    variables = model.trainable_variables
    grads = tape.gradient(loss, variables)
    before = [v.numpy().copy() for v in variables]
    LARS(args.lr, momentum=0.0, eta=args.eta, clip_trust_ratio=args.clip).apply(grads, variables)
    print(f"lr {args.lr:g}  eta {args.eta:g}  clip {args.clip}  lr*eta {args.lr * args.eta:g}")
    print(f"{'variable':<25} {'shape':>9} {'||w||':>7} {'||g||':>7} {'trust':>8} {'||dw||/||w||':>13}")
    for v, g, w0 in zip(variables, grads, before):
        w_norm, g_norm = np.linalg.norm(w0), np.linalg.norm(g.numpy())
        trust = f"{args.eta * w_norm / g_norm:8.5f}" if v.ndim > 1 and w_norm > 0 else "excluded"
        moved = f"{np.linalg.norm(v.numpy() - w0) / w_norm:13.5f}" if w_norm > 0 else f"{'(w = 0)':>13}"
        shape = "x".join(map(str, v.shape))
        print(f"{v.path:<25} {shape:>9} {w_norm:7.3f} {g_norm:7.4f} {trust:>8} {moved}")


if __name__ == "__main__":
    main()
