"""The metadata check carried in messages (allreduce/algorithms/agree.py).

Thread ranks: the heads' merge and schedule at p = 1..7 (every rank learns of a mismatch on any
rank, folded or not). Under MPI (tests/mpi/check_carried.py): rd carrying the head in its
mailbox exchanges and every other vehicle, results and mismatches of every field.
"""
import numpy as np
import pytest

from allreduce.algorithms import agree
from allreduce.transport.threads import run_threads

from .harness import mpirun


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7])
def test_every_rank_learns_whether_any_rank_differs(p):
    for odd in [None, *range(p)]:
        def body(t):
            fields = (100, 3, 1, 0, -1, -1, 7 + (t.rank == odd))
            return agree.agree(t, agree.head(fields))
        merged = run_threads(p, body, timeout=20)
        assert len(set(merged)) == 1, merged                   # the same verdict on every rank
        assert agree.agrees(merged[0]) == (odd is None or p == 1), (odd, merged)


def test_head_is_two_int64s_that_differ_for_different_fields():
    a, b = agree.head((4, 0, 0, 1, -1, -1, 0)), agree.head((5, 0, 0, 1, -1, -1, 0))
    assert a != b and agree.agrees(a) and not agree.agrees((max(a[0], b[0]), max(a[1], b[1])))
    assert all(np.iinfo(np.int64).min < w <= np.iinfo(np.int64).max for w in a + b)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])     # -np 4 (two carried steps) passes too: by hand
def test_mpi_check_carried_results_and_every_field_mismatch(np_):
    out = mpirun(np_, "check_carried.py", timeout=240).stdout
    assert f"OK check_carried on {np_} ranks:" in out, out[-2000:]
    assert f"(rd carries the head: {np_ != 3})" in out
