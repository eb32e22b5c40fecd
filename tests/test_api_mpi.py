"""The public API on real MPI processes, np = 1..5, every available algorithm."""
import pytest

from .harness import mpirun

ALGOS = "ring,mpi"


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [1, 2, 3, 4, 5])
def test_api_against_mpi_allreduce(np_):
    out = mpirun(np_, "api_check.py", ALGOS, timeout=240).stdout
    assert f"on {np_} ranks" in out


@pytest.mark.mpi
def test_64mib_every_algorithm():
    # tree, rhd and rd have their own np = 1..5 MPI matrices (tests/mpi/tree_rd_check.py,
    # collectives_check.py); here every algorithm also runs the 64 MiB case and the API checks.
    out = mpirun(2, "api_check.py", "ring,tree,rhd,rd,mpi,shm,hierarchical", "--large", timeout=300).stdout
    assert "OK" in out


def test_call_before_init_is_a_type_error():
    import numpy as np
    import allreduce as ar
    with pytest.raises(TypeError, match="init"):
        ar.allreduce(np.ones(3))
