"""Elastic training with tfops.ShardedOptimizer: a death, a shrink, a regrow (tests/test_sharding.py).

::

    SHARD_KILL=2@5 allreduce-run --elastic -np 3 --max-np 3 python tests/mpi/sharding_elastic.py

An eager custom loop (``SHARD_FIT=1``: ``model.fit`` with ``CommitStateCallback``) with Adam
sharded over the world, a commit every 2 steps. World rank 2
SIGKILLs itself before step 5. The survivors restore the last commit; on reset (the world is
now 2) they re-shard and check that the model and the whole optimizer state, gathered from the
new shards, equal the commit, bit for bit, the dead rank's shard included (``RESHARDED-OK``).
The next commit spawns a replacement (``--max-np 3``), which gets the commit by sync; every rank
re-shards for 3 at its next step. Each process prints ``SHARD <name> <size> step=<s> <digest>``
at the end: the digest covers the weights and the gathered optimizer state.
"""
from __future__ import annotations

import hashlib
import os
import signal

import numpy as np
import keras
import tensorflow as tf

import tfops.keras as hvd
import tfops.keras.elastic  # noqa: F401
from allreduce.elastic import world
from tfops.sharding import elastic as shard_elastic

STEPS = 12
who, when = os.environ.get("SHARD_KILL", "-1@0").split("@")
KILL = (int(who), int(when))
FIT = os.environ.get("SHARD_FIT") == "1"          # model.fit in place of the eager loop


def gathered(opt) -> list:
    state = opt._gathered()
    return [state.gather(i, s) for i, s in state.order]


def main() -> None:
    hvd.init()
    me = world.name()
    keras.utils.set_random_seed(me)               # different starting weights per rank: sync must fix that
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(1)])
    opt = hvd.ShardedOptimizer(keras.optimizers.Adam(0.05))
    state = hvd.elastic.TensorFlowKerasState(model, opt, step=0)
    data = np.random.default_rng(7)
    x = data.standard_normal((STEPS, 8, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)

    def check_resharded():
        if getattr(opt, "_pending_state", None) is None:   # a regrow: the commit comes with the sync that follows
            return
        shard_elastic.reshard_if_needed(opt)
        same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), state._saved_model))
        full = [v.numpy() for v in opt.inner_optimizer.variables[:2]] + gathered(opt)
        same &= len(full) == len(state._saved_opt) and all(np.array_equal(a, b) for a, b in zip(full, state._saved_opt))
        print("RESHARDED-OK" if same else "RESHARDED-WRONG", me, hvd.size(), flush=True)

    state.register_reset_callbacks([check_resharded])

    class Kill(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if (me, state.step) == KILL:
                print(f"KILL {me} step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            state.step += 1

    @hvd.elastic.run
    def fit(state):
        # model.fit: the traced train function holds the layout, so a reset must make a new one
        r, p = hvd.rank(), hvd.size()
        xs = np.concatenate([x[s][r::p] for s in range(state.step, STEPS)])
        ys = np.concatenate([y[s][r::p] for s in range(state.step, STEPS)])
        model.fit(xs, ys, batch_size=len(x[0][r::p]), epochs=1, shuffle=False, verbose=0,
                  callbacks=[Kill(), hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            if (me, state.step) == KILL:
                print(f"KILL {me} step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            r, p = hvd.rank(), hvd.size()
            with tf.GradientTape() as tape:              # this rank's share of the step's batch
                loss = tf.reduce_mean((model(x[state.step][r::p]) - y[state.step][r::p]) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            state.step += 1
            if state.step % 2 == 0:
                state.commit()

    if FIT:
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        fit(state)
    else:
        train(state)
    h = hashlib.sha256()
    for value in model.get_weights() + gathered(opt):
        h.update(np.ascontiguousarray(value).tobytes())
    print(f"SHARD {me} {hvd.size()} step={state.step} iterations={int(opt.iterations.numpy())} {h.hexdigest()[:32]}",
          flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
