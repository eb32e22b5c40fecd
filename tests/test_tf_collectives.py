"""tfops alltoall, reducescatter, grouped_allgather/_reducescatter and process sets: one process, 2 and 3 ranks.

All checks live in one rank script per world size (tests/mpi/tf_collectives.py; its docstring lists
them): TensorFlow's import dominates the cost, the checks themselves take seconds.
"""
import pytest

from .harness import TF_ENV, mpirun, run_alone

pytest.importorskip("tensorflow")

TIMEOUT = 400       # TF's import takes tens of seconds when the 2 cores are shared
pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def test_collectives_and_process_sets_one_process_without_mpirun():
    out = run_alone("tf_collectives.py", timeout=TIMEOUT, env=TF_ENV)
    assert "rank 0: tf_collectives OK" in out, out[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_and_process_sets_under_mpirun(ranks):
    out = mpirun(ranks, "tf_collectives.py", timeout=TIMEOUT, env=TF_ENV).stdout
    assert all(f"rank {r}: tf_collectives OK" in out for r in range(ranks)), out[-3000:]
