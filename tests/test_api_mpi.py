"""The public API on real MPI processes, np = 1..5, every available algorithm."""
import pytest

from .harness import mpirun

ALGOS = "ring,mpi"


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [1, 2, 3, 4, 5])
def test_api_tree_rd_and_collectives_against_mpi(np_):
    """Three matrices in one job per world size (tests/mpi/matrix_check.py): the public API with ring
    and mpi (api_check.py), tree and rd with small segments (tree_rd_check.py), and rhd, broadcast,
    allgather, reducescatter (collectives_check.py), each against MPI's own collectives."""
    out = mpirun(np_, "matrix_check.py", timeout=300).stdout
    assert "OK" in out and f"cases on {np_} ranks: {ALGOS}" in out, out[-2000:]
    assert f"OK tree,rd on {np_} ranks" in out, out[-2000:]
    assert f"collectives_check OK on {np_} ranks" in out, out[-2000:]


@pytest.mark.mpi
def test_64mib_every_algorithm():
    # tree, rhd and rd have their own np = 1..5 MPI matrices (tests/mpi/tree_rd_check.py,
    # collectives_check.py, run by the test above); here every algorithm also runs the 64 MiB case.
    out = mpirun(2, "api_check.py", "ring,tree,rhd,rd,mpi,shm,hierarchical", "--large", timeout=300).stdout
    assert "OK" in out


@pytest.mark.mpi
def test_small_integer_sums_wrap_as_in_c_by_every_algorithm():
    # Open MPI's vectorised sum saturates int8/uint8/int16/uint16 where they overflow; the mpi
    # algorithm reduces those with our kernel (allreduce/algorithms/native.py)
    out = mpirun(3, "native_wrap_check.py", timeout=120).stdout
    assert all(f"rank {r}: native_wrap_check OK" in out for r in range(3)), out[-2000:]


def test_call_before_init_is_a_type_error():
    import numpy as np
    import allreduce as ar
    with pytest.raises(TypeError, match="init"):
        ar.allreduce(np.ones(3))


@pytest.mark.mpi
def test_the_issue_one_liner_under_plain_mpirun(tmp_path, monkeypatch):
    """`mpirun -np 4 python -c "...ar.allreduce(np.ones(10)*ar.rank(), op=ar.Sum)"`: every rank prints
    ten 6s, and Open MPI's UCX one-sided component stays quiet without allreduce-run's settings
    (allreduce/transport/mpi.py leaves it out unless the user chose an osc component)."""
    monkeypatch.delenv("OMPI_MCA_osc", raising=False)     # this process may have set it on import
    script = tmp_path / "one_liner.py"
    script.write_text("import allreduce as ar, numpy as np; ar.init(); "
                      "print(ar.allreduce(np.ones(10)*ar.rank(), op=ar.Sum))\n")
    proc = mpirun(4, script, timeout=120)
    assert proc.stdout.splitlines() == ["[6. 6. 6. 6. 6. 6. 6. 6. 6. 6.]"] * 4, proc.stdout
    assert "UCX" not in proc.stderr, proc.stderr[-2000:]
