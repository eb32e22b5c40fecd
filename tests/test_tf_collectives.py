"""tfops alltoall, reducescatter, grouped_allgather/_reducescatter and process sets: one process, 2 and 3 ranks.

All checks live in one rank script per world size (tests/mpi/tf_collectives.py; its docstring lists
them): TensorFlow's import dominates the cost, the checks themselves take seconds.
"""
import subprocess
import sys

import pytest

from .harness import MPI_SCRIPTS, mpi_env, mpirun

pytest.importorskip("tensorflow")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "1"}
TIMEOUT = 400       # TF's import takes tens of seconds when the 2 cores are shared
pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def test_collectives_and_process_sets_one_process_without_mpirun():
    env = mpi_env()
    env.update(ENV)
    try:
        proc = subprocess.run([sys.executable, str(MPI_SCRIPTS / "tf_collectives.py")], env=env,
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"TIMEOUT after {TIMEOUT} s: python tf_collectives.py\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0: tf_collectives OK" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_and_process_sets_under_mpirun(ranks):
    out = mpirun(ranks, "tf_collectives.py", timeout=TIMEOUT, env=ENV).stdout
    assert all(f"rank {r}: tf_collectives OK" in out for r in range(ranks)), out[-3000:]
