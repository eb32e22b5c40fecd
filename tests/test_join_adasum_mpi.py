"""``join()`` and ``op=Adasum`` under mpirun: the core API at -np 3 (tfops' at -np 2,
tests/mpi/tf_join_adasum.py, runs in tests/test_tf_rank_scripts.py's launch).

The rank scripts' docstrings list their checks (tests/mpi/join_check.py,
tests/mpi/tf_join_adasum.py). The thread-rank tests (test_engine_join.py,
test_adasum.py) cover the engine and the algorithm at more sizes, cheaply.
"""
import pytest

from .harness import mpirun


@pytest.mark.mpi
def test_join_uneven_steps_and_adasum_errors_3_ranks():
    out = mpirun(3, "join_check.py", timeout=300).stdout
    assert all(f"rank {r}: join_check OK" in out for r in range(3)), out[-3000:]
