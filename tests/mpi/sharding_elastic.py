"""Elastic training with tfops.ShardedOptimizer, stage 2 and stage 3 side by side: a death, a
shrink, a regrow (tests/test_sharding.py).

::

    SHARD_KILL=2@5 allreduce-run --elastic -np 3 --max-np 3 python tests/mpi/sharding_elastic.py

Two copies of one model train on the same batches, under one commit: ``model`` with
``ShardedOptimizer(AdamW)`` (stage 2; the biases excluded from weight decay by variable) and
``model3``, wrapped by ``tfops.fully_shard``, with ``ShardedOptimizer(AdamW, stage=3)`` (excluded
by name; each rank holds 1/p of every weight and slot), each in its ``TensorFlowKerasState``
(``Both`` commits, restores and syncs the two together). The loop is a custom one (stage 2 eagerly, stage 3 in a ``tf.function`` made again in a reset callback), or
``SHARD_FIT=1``: ``model.fit`` with ``CommitStateCallback``, ``model3.train_on_batch`` in a callback.
A commit every 2 steps. World rank 2 SIGKILLs itself before step 5. The survivors restore the
last commit; on reset (the world is now 2) they check:

* a fully sharded model kept in no state (``stray``) raises, naming the rank, that it has no
  commit to re-cut from; ``model3`` before its re-cut raises that the sync re-cuts it;
* after the re-shard, each model and the whole optimizer state, gathered from the new shards,
  equal the commit bit for bit, the dead rank's shard included (``RESHARDED-OK``,
  ``RESHARDED3-OK``);
* custom loop: the stage-3 ``tf.function`` traced before the re-cut raises instead of running.

The next commit spawns a replacement (``--max-np 3``), which wraps its ``model3`` alone and gets
the commit by sync; every rank re-shards for 3. Each process prints ``SHARD`` and ``SHARD3 <name>
<size> step=<s> iterations=<i> <digest>`` at the end (the digest covers the weights and the
gathered optimizer state) and ``TWIN <name> <max |stage 3 - stage 2|>``: the two copies lived
through the same worlds on the same batches.
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
from tfops.sharding import elastic as shard_elastic, elastic_stage3
from tfops.sharding.fully_shard import fully_shard, gathered_weights, state_of

STEPS = 12
who, when = os.environ.get("SHARD_KILL", "-1@0").split("@")
KILL = (int(who), int(when))
FIT = os.environ.get("SHARD_FIT") == "1"          # model.fit in place of the eager loop


def gathered(opt) -> list:
    state = opt._gathered()
    return [state.gather(i, s) for i, s in state.order]


def gathered3(opt3) -> list:
    """Stage 3's whole optimizer state, as a commit holds it (a collective)."""
    store: dict = {}
    opt3.save_own_variables(store)
    return [store[str(i)] for i in range(len(store))]


def equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))


def raises(fn, words: str) -> bool:
    """Whether ``fn()`` raises an error whose text holds ``words``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a RuntimeError, or TensorFlow's wrapping of one
        return words in str(e)
    return False


class Both(hvd.elastic.TensorFlowKerasState):
    """The stage-2 model's state that commits, restores and syncs the stage-3 model's with it."""

    def __init__(self, model, optimizer, other, **kwargs):
        self.other = other
        super().__init__(model, optimizer, **kwargs)

    def save(self):
        self.other.save()
        super().save()

    def restore(self):
        self.other.restore()
        super().restore()

    def sync(self):
        self.other.sync()
        super().sync()


def main() -> None:
    hvd.init()
    me = world.name()
    keras.utils.set_random_seed(me)               # different starting weights per rank: sync must fix that
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(1)])
    # AdamW, the biases excluded from its decay: by variable for stage 2 (the wrapper keeps the model
    # keys and maps them onto each new layout's segments), by name for stage 3 (its re-cut maps the
    # pieces' keys); a re-shard that dropped either exclusion decays those biases and the twins part
    inner = keras.optimizers.AdamW(0.05, weight_decay=0.2)
    inner.exclude_from_weight_decay(var_list=[layer.bias for layer in model.layers])
    opt = hvd.ShardedOptimizer(inner)
    model3 = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(1)])
    model3.set_weights(model.get_weights())       # the twin: rank 0's weights reach both (broadcast, sync)
    fully_shard(model3)
    inner3 = keras.optimizers.AdamW(0.05, weight_decay=0.2)
    inner3.exclude_from_weight_decay(var_names=["bias"])
    opt3 = hvd.ShardedOptimizer(inner3, stage=3)
    stray = fully_shard(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))   # in no state
    state = Both(model, opt, hvd.elastic.TensorFlowKerasState(model3, opt3), step=0)
    state3 = state.other
    data = np.random.default_rng(7)
    x = data.standard_normal((STEPS, 8, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)

    def step3(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model3(xb) - yb) ** 2)
        grads = tape.gradient(loss, model3.trainable_variables)
        opt3.apply_gradients(zip(grads, model3.trainable_variables))

    def traced3():                                # one signature: a new world's batch shape reuses the trace
        return tf.function(step3, input_signature=[tf.TensorSpec([None, 4]), tf.TensorSpec([None, 1])])

    traced = {"step3": traced3()}

    def check_resharded():
        old_step3, traced["step3"] = traced["step3"], traced3()    # the old trace holds the old pieces
        if getattr(opt, "_pending_state", None) is None:   # a regrow: the commit comes with the sync that follows
            return
        shard_elastic.reshard_if_needed(opt)
        same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), state._saved_model))
        full = [v.numpy() for v in opt.inner_optimizer.variables[:2]] + gathered(opt)
        same &= len(full) == len(state._saved_opt) and all(np.array_equal(a, b) for a, b in zip(full, state._saved_opt))
        print("RESHARDED-OK" if same else "RESHARDED-WRONG", me, hvd.size(), flush=True)
        # stage 3: what a step does before the re-cut, the re-cut, what an old trace does after it
        errors = raises(lambda: stray(x[0]), f"rank {hvd.rank()}: the world changed (now 2 ranks) but fully "
                        "sharded model") and raises(lambda: model3(x[0]), "the elastic state's sync re-cuts it")
        elastic_stage3.reshard_if_needed(model3, opt3)
        same3 = equal(gathered_weights(model3), state3._saved_model) and equal(gathered3(opt3), state3._saved_opt)
        n, pieces = sum(w.size for w in state3._saved_model), sum(int(np.prod(v.shape)) for v in model3.trainable_variables)
        same3 &= pieces in (n // 2, -(-n // 2))           # cut for 2: floor or ceil of N/2 here
        if not FIT:
            errors &= raises(lambda: old_step3(x[0], y[0]), "was re-cut for 2 ranks after this tf.function")
        print("STAGE3-ERRORS-OK" if errors else "STAGE3-ERRORS-WRONG", me, flush=True)
        print("RESHARDED3-OK" if same3 else "RESHARDED3-WRONG", me, hvd.size(), state_of(model3).generation,
              flush=True)

    state.register_reset_callbacks([check_resharded])

    class Stage3(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):     # the twin's step, on the same batch
            r, p = hvd.rank(), hvd.size()
            model3.train_on_batch(x[state.step][r::p], y[state.step][r::p])

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
                  callbacks=[Stage3(), Kill(), hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])

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
            traced["step3"](x[state.step][r::p], y[state.step][r::p])
            state.step += 1
            if state.step % 2 == 0:
                state.commit()

    if FIT:
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        model3.compile(optimizer=opt3, loss="mse", jit_compile=False)
        fit(state)
    else:
        train(state)
    h = hashlib.sha256()
    for value in model.get_weights() + gathered(opt):
        h.update(np.ascontiguousarray(value).tobytes())
    print(f"SHARD {me} {hvd.size()} step={state.step} iterations={int(opt.iterations.numpy())} {h.hexdigest()[:32]}",
          flush=True)
    whole3, h3 = gathered_weights(model3), hashlib.sha256()
    for value in whole3 + gathered3(opt3):
        h3.update(np.ascontiguousarray(value).tobytes())
    print(f"SHARD3 {me} {hvd.size()} step={state.step} iterations={int(opt3.iterations.numpy())} "
          f"{h3.hexdigest()[:32]}", flush=True)
    print(f"TWIN {me} {max(np.abs(a - b).max() for a, b in zip(whole3, model.get_weights())):.3e}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
