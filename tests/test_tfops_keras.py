"""tfops' Keras side of Horovod's API (issue 27): one process, and 2 and 3 ranks under mpirun.

The checks live in one rank script, tests/mpi/tf_keras_parity.py (its docstring lists
them), run once per world size: TensorFlow's import is most of each launch's time.
"""
import pytest

from .harness import TF_ENV, mpirun, run_alone

pytest.importorskip("tensorflow")

TIMEOUT = 400                       # TF's import alone takes tens of seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def test_keras_parity_one_process_without_mpirun():
    out = run_alone("tf_keras_parity.py", timeout=TIMEOUT, env=TF_ENV)
    assert "rank 0: tf_keras_parity OK" in out, out[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [3])     # 3: uneven shards, not a power of two; 1 process: the test below (2 was dropped for the 15-minute suite)
def test_keras_parity_under_mpirun(np_):
    out = mpirun(np_, "tf_keras_parity.py", timeout=TIMEOUT, env=TF_ENV).stdout
    assert all(f"rank {r}: tf_keras_parity OK" in out for r in range(np_)), out[-3000:]
