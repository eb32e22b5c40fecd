"""Comm hooks on real MPI processes: bitwise identical results on every rank at -np 2, 3 and 4."""
import pytest

from .harness import mpirun


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 3, 4])
def test_hooks_are_bitwise_identical_on_every_rank_and_mismatches_raise_everywhere(p):
    out = mpirun(p, "hooks_check.py", timeout=180).stdout
    assert out.count("OK hooks_check") == p, out

