"""Elastic ``model.fit`` with the three callbacks, a rank killing itself and one raising (tests/test_elastic.py).

::

    ELASTIC_KERAS_KILL=2@1:5 ELASTIC_KERAS_RAISE=0@2:3 allreduce-run --elastic -np 3 --max-np 3 \
        python tests/mpi/elastic_keras.py

World rank 2 SIGKILLs itself at epoch 1, batch 5. The survivors restore the last
commit (every 2 batches), check that the model and optimizer hold exactly the
committed values (``RESTORED-OK``), sync, and go on; under ``--max-np 3`` the
next commit (``CommitStateCallback``, inside ``model.fit``) spawns a replacement,
named 3, that builds its model, gets the commit by sync (its optimizer's slots
built to match) and finishes the remaining batches and epochs with them. Then
rank 0's callback raises ``RuntimeError`` at epoch 2, batch 3: it leaves the job
(allreduce/elastic/failure.py), the others recover as after a death, and a
replacement named 4 joins at the next commit. Each
process prints ``KERAS <name> <size> epoch=<e> <digest>``; the digest covers the
weights and every optimizer variable (momentum, iterations).
"""
from __future__ import annotations

import hashlib
import os
import signal

import numpy as np
import keras

import tfops.keras as hvd
import tfops.keras.elastic  # noqa: F401 - hvd.elastic, also while tfops.keras/__init__ is being edited
from allreduce.elastic import world

EPOCHS, BATCHES, BS = 3, 8, 4
ME = -1                     # this process's name (allreduce.elastic.world), known after init
who, when = os.environ.get("ELASTIC_KERAS_KILL", "-1@0:0").split("@")
KILL = (int(who), *map(int, when.split(":")))
who, when = os.environ.get("ELASTIC_KERAS_RAISE", "-1@0:0").split("@")
RAISE = (int(who), *map(int, when.split(":")))


class Killer(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_begin(self, batch, logs=None):
        if (ME, self.state.epoch, self.state.batch) == KILL:
            print(f"KILL {ME} epoch {self.state.epoch} batch {self.state.batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if (ME, self.state.epoch, self.state.batch) == RAISE:
            raise RuntimeError(f"callback raised on name {ME} at epoch {self.state.epoch} batch {self.state.batch}")


def digest(model, optimizer) -> str:
    h = hashlib.sha256()
    for value in model.get_weights() + [v.numpy() for v in optimizer.variables]:
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:32]


def main() -> None:
    global ME
    hvd.init()
    ME = world.name()
    keras.utils.set_random_seed(ME)            # different starting weights per rank: sync must fix that
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    model.compile(loss="mse", optimizer=optimizer, jit_compile=False)
    rng = np.random.default_rng(100 + ME)
    x = rng.standard_normal((BATCHES * BS, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    state = hvd.elastic.KerasState(model, optimizer, epoch=0, batch=0)

    def check_restored():
        same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), state._saved_model))
        same &= all(np.array_equal(v.numpy(), s) for v, s in zip(optimizer.variables, state._saved_opt))
        print("RESTORED-OK" if same else "RESTORED-WRONG", ME, hvd.size(), flush=True)

    state.register_reset_callbacks([check_restored])
    callbacks = [Killer(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]

    @hvd.elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            start = state.batch * BS                      # a resumed epoch skips the committed batches
            model.fit(x[start:], y[start:], batch_size=BS, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)

    train(state)
    print(f"KERAS {ME} {hvd.size()} epoch={state.epoch} {digest(model, optimizer)}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
