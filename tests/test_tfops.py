"""tfops (TensorFlow / Keras on the engine): one process, and 2 and 3 ranks under mpirun.

Importing TensorFlow costs ~10 s per process, so the checks are grouped into
rank scripts (tests/mpi/tf_ops.py, which also runs tf_surface.py's checks,
and tf_train.py; their docstrings list what they check), each run once per
world size. TF runs
with one intra-op and one inter-op thread.
"""
import pytest

from .harness import TF_ENV, mpirun, run_alone

pytest.importorskip("tensorflow")

# TF's import alone takes tens of seconds when the 2 cores are shared; the checks themselves ~10 s.
TIMEOUT = 400
pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def test_ops_and_gradients_one_process_without_mpirun():
    out = run_alone("tf_ops.py", timeout=TIMEOUT, env=TF_ENV)
    assert "rank 0: tf_ops OK" in out, out[-3000:]


@pytest.mark.mpi
def test_ops_gradients_and_errors_3_ranks():
    out = mpirun(3, "tf_ops.py", timeout=TIMEOUT, env=TF_ENV).stdout
    assert all(f"rank {r}: tf_ops OK" in out for r in range(3)), out[-3000:]


@pytest.mark.mpi
def test_horovod_surface_2_ranks():
    """tests/mpi/tf_surface.py (issue 27's ops, arguments, errors, gradients and dtypes); it also
    runs inside tf_ops.py, so the tests above cover one and three ranks."""
    out = mpirun(2, "tf_surface.py", timeout=TIMEOUT, env=TF_ENV).stdout
    assert all(f"rank {r}: tf_surface OK" in out for r in range(2)), out[-3000:]


@pytest.mark.mpi
def test_training_matches_single_process_2_ranks():
    out = mpirun(2, "tf_train.py", timeout=TIMEOUT, env=TF_ENV).stdout
    assert all(f"rank {r}: tf_train OK" in out for r in range(2)), out[-3000:]
