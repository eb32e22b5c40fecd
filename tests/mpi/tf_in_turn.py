"""Rank script: several TensorFlow rank scripts in one process, one after the other.

Run by tests/test_tf_rank_scripts.py as
``mpirun -np P python tf_in_turn.py tf_ops.py -- tf_keras_parity.py -- tf_collectives.py``
(scripts and their arguments, separated by ``--``; names are files in tests/mpi/).

Why: importing TensorFlow, Keras and tfops costs about 5 CPU-seconds a process, and the suite
used to start one process per rank for each script. Run in turn, each world size pays it once.

Each script runs as ``__main__`` (``runpy``) with its own ``sys.argv``, on a fresh engine: the
runner shuts the engine down between scripts (a script's own ``hvd.shutdown()`` is fine too),
clears Keras' session and puts back the float32 policy. It first waits for every rank (a
barrier): one rank's shutdown stops every rank's engine, and a rank that finished early (a
pipeline's last stage) must not stop a peer's engine while that peer still runs the script.
TF's thread counts can be set only before its runtime starts, so after the first script a call
that asks for the same count is a no-op, and one that asks for another raises. A script that raises ends the job the way it
would alone (tfops' fault hook aborts every rank, naming this one); the runner first prints
``tf_in_turn: <script> raised`` so the test can say which one. After each script that ends
normally, every rank prints ``tf_in_turn: <script> done (<seconds> s)``.
"""
import os
import runpy
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _once(setter, getter):
    """TF's thread-count setter that accepts the value already in force after the runtime has started."""
    def set_threads(n: int) -> None:
        try:
            setter(n)
        except RuntimeError:
            if getter() != n:
                raise
    return set_threads


tf.config.threading.set_intra_op_parallelism_threads = _once(
    tf.config.threading.set_intra_op_parallelism_threads, tf.config.threading.get_intra_op_parallelism_threads)
tf.config.threading.set_inter_op_parallelism_threads = _once(
    tf.config.threading.set_inter_op_parallelism_threads, tf.config.threading.get_inter_op_parallelism_threads)


def scripts(argv: list[str]) -> list[list[str]]:
    """``a.py x -- b.py -- c.py y z`` -> [[a.py, x], [b.py], [c.py, y, z]]."""
    runs, current = [], []
    for word in argv:
        if word == "--":
            runs.append(current)
            current = []
        else:
            current.append(word)
    runs.append(current)
    if not all(runs):
        raise SystemExit(f"tf_in_turn: an empty script between '--' in {argv}")
    return runs


def fresh_start() -> None:
    """What one script may leave behind that the next must not see."""
    import keras
    import tfops
    from allreduce import api
    if tfops.is_initialized():
        if tfops.size() > 1:
            api.barrier()     # a rank's shutdown stops every engine: wait until all have left the script
        tfops.shutdown()
    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session()


def run(words: list[str]) -> None:
    path = HERE / words[0]
    sys.argv = [str(path), *words[1:]]
    start = time.perf_counter()
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            print(f"tf_in_turn: {words[0]} exited {done.code}", flush=True)
            raise
    except BaseException:
        print(f"tf_in_turn: {words[0]} raised", flush=True)
        raise
    print(f"tf_in_turn: {words[0]} done ({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    for words in scripts(sys.argv[1:]):
        run(words)
        fresh_start()
