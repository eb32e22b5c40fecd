"""tfops' Keras side of Horovod's API (issue 27): one process, and 2 and 3 ranks under mpirun.

The checks live in one rank script, tests/mpi/tf_keras_parity.py (its docstring lists
them), run once per world size: TensorFlow's import is most of each launch's time.
"""
import subprocess
import sys

import pytest

from .harness import MPI_SCRIPTS, mpi_env, mpirun

pytest.importorskip("tensorflow")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "1"}
TIMEOUT = 400                       # TF's import alone takes tens of seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def test_keras_parity_one_process_without_mpirun():
    env = mpi_env()
    env.update(ENV)
    try:
        proc = subprocess.run([sys.executable, str(MPI_SCRIPTS / "tf_keras_parity.py")], env=env,
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"TIMEOUT after {TIMEOUT} s: python tf_keras_parity.py\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0: tf_keras_parity OK" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_keras_parity_under_mpirun(np_):
    out = mpirun(np_, "tf_keras_parity.py", timeout=TIMEOUT, env=ENV).stdout
    assert all(f"rank {r}: tf_keras_parity OK" in out for r in range(np_)), out[-3000:]
