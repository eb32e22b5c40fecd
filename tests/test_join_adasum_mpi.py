"""``join()`` and ``op=Adasum`` under mpirun: the core API at -np 3, tfops at -np 2.

The rank scripts' docstrings list their checks (tests/mpi/join_check.py,
tests/mpi/tf_join_adasum.py). The thread-rank tests (test_engine_join.py,
test_adasum.py) cover the engine and the algorithm at more sizes, cheaply.
"""
import pytest

from .harness import TF_ENV, mpirun
TIMEOUT = 400            # TF's import alone takes tens of seconds when the 2 cores are shared


@pytest.mark.mpi
def test_join_uneven_steps_and_adasum_errors_3_ranks():
    out = mpirun(3, "join_check.py", timeout=300).stdout
    assert all(f"rank {r}: join_check OK" in out for r in range(3)), out[-3000:]


@pytest.mark.mpi
@pytest.mark.timeout(TIMEOUT + 30)
def test_tfops_join_and_adasum_eager_tf_function_and_tape_2_ranks():
    pytest.importorskip("tensorflow")
    out = mpirun(2, "tf_join_adasum.py", timeout=TIMEOUT, env=TF_ENV).stdout
    assert all(f"rank {r}: tf_join_adasum OK" in out for r in range(2)), out[-3000:]
