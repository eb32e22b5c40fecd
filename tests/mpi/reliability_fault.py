"""Rank script for tests/test_reliability_engine_mpi.py: break rank 1 during engine traffic or model.fit.

    python reliability_fault.py engine-exit    rank 1 calls os._exit(3) in an allreduce_async loop
    python reliability_fault.py engine-kill    rank 1 SIGKILLs itself in an allreduce_async loop
    python reliability_fault.py engine-raise   rank 1 raises ValueError in its "training code"
                                               while the others wait on engine handles
    python reliability_fault.py fit-kill       rank 1 SIGKILLs itself inside model.fit
                                               (tfops.keras DistributedOptimizer)
    python reliability_fault.py fit-raise      a Keras callback raises on rank 1 inside model.fit

The broken rank prints ``rank 1 breaks at <unix time>`` first, so the test can
measure how long the survivors took to go. A survivor that gets out of its
loop prints ``UNREACHABLE``.
"""
import os
import signal
import sys
import threading
import time

import numpy as np

mode = sys.argv[1]
BROKEN = 1


def break_now(how: str) -> None:
    print(f"rank {BROKEN} breaks at {time.time():.3f} ({how})", flush=True)
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("boom in training code")


def engine_loop(ar, me: int) -> None:
    """Steps of 40 named tensors, each rank in its own order, all waited on."""
    rng = np.random.default_rng(me)
    names = [f"layer{i}" for i in range(40)]
    grads = {n: np.full(1000 + 97 * i, 1.0, np.float32) for i, n in enumerate(names)}
    if me == BROKEN and mode in ("engine-exit", "engine-kill"):
        # A timer thread, so the death lands while handles are in flight, not between steps.
        threading.Timer(2.0, break_now, args=(mode.split("-")[1],)).start()
    for step in range(1_000_000):
        if me == BROKEN and mode == "engine-raise" and step == 20:
            break_now("raise")
        handles = [ar.allreduce_async(grads[n], name=n, op=ar.Sum) for n in rng.permutation(names)]
        for h in handles:
            assert ar.synchronize(h)[0] == ar.size()


def fit(me: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import tfops.keras as hvd

    hvd.init()
    rng = np.random.default_rng(me)
    x = rng.standard_normal((4096, 8)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Break(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if me == BROKEN and batch == 30:
                break_now("kill" if mode == "fit-kill" else "raise")

    print(f"rank {me} fitting", flush=True)
    model.fit(x, y, batch_size=8, epochs=1000, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Break()])


if mode.startswith("fit"):
    fit(int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
else:
    import allreduce as ar
    ar.init()
    engine_loop(ar, ar.rank())
print(f"rank {os.environ.get('OMPI_COMM_WORLD_RANK')} UNREACHABLE: finished without noticing the fault",
      flush=True)
