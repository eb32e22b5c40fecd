"""tfops' TensorFlow rank scripts, several to a launch: one launch per world size (1, 2 and 3).

Importing TensorFlow, Keras and tfops costs about 5 CPU-seconds a process, and the scripts' own
checks take seconds to a minute. Each world size's scripts therefore run one after the other in
the same processes (tests/mpi/tf_in_turn.py: a fresh engine, Keras session and float32 policy
between them), and each script is still a test of its own here, passed or failed by the marker
its ranks print. The scripts' docstrings list what they check:

- tests/mpi/tf_ops.py (it also runs tf_surface.py's checks): ops, gradients and errors;
- tf_surface.py: issue 27's ops, arguments, errors, gradients and dtypes;
- tf_train.py: training equals the single process (tape, optimizer, overlap's buckets);
- tf_keras_parity.py: the Keras side of Horovod's API, mixed precision in both wrapping orders;
- tf_collectives.py: alltoall, reducescatter, grouped allgather/reducescatter, process sets;
- tf_comm_hooks.py --digits: communication hooks in fit, loops and tf.function, and the digits
  model's test accuracy with each hook;
- tf_join_adasum.py: join() and op=Adasum eagerly, in tf.function and through the tape.

A script that raises ends its launch (tfops' fault hook aborts every rank): its test fails with
the launch's output, and every later script of that launch fails naming it.
"""
from __future__ import annotations

import pytest

from .harness import TF_ENV, check_in_turn, launch_in_turn

pytest.importorskip("tensorflow")

PER_SCRIPT = 400          # seconds a script may take on a loaded 2-core machine (TF's import included)

LAUNCHES = {
    1: [("tf_ops",), ("tf_keras_parity",), ("tf_collectives",)],
    # 3: uneven shards and not a power of two; 2: the rest (2 for tf_keras_parity was dropped for time)
    2: [("tf_surface",), ("tf_train",), ("tf_collectives",), ("tf_comm_hooks", "--digits"), ("tf_join_adasum",)],
    3: [("tf_ops",), ("tf_keras_parity",), ("tf_collectives",)],
}

_outputs: dict[int, str] = {}


def _launch(size: int) -> str:
    """The output of ``size``'s launch (run once per pytest process; xdist keeps this file on one worker)."""
    if size not in _outputs:
        _outputs[size] = launch_in_turn(size, LAUNCHES[size], per_script=PER_SCRIPT, env=TF_ENV)
    return _outputs[size]


CASES = [pytest.param(size, run, id=f"np{size}-{run[0]}") for size, runs in LAUNCHES.items() for run in runs]


@pytest.mark.mpi
@pytest.mark.timeout(PER_SCRIPT * 5 + 60)
@pytest.mark.parametrize("size, run", CASES)
def test_rank_script(size, run):
    script = run[0]
    out = _launch(size)
    check_in_turn(out, size, script)
    if script == "tf_comm_hooks":
        assert "digits test accuracy: none" in out, out[-3000:]
