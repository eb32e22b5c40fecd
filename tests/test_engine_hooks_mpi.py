"""Comm hooks on real MPI processes: bitwise identical results on every rank at -np 2, 3 and 4."""
import pytest

from .harness import mpirun


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 3, 4])
def test_hooks_are_bitwise_identical_on_every_rank_and_mismatches_raise_everywhere(p):
    out = mpirun(p, "hooks_check.py", timeout=180).stdout
    assert out.count("OK hooks_check") == p, out


@pytest.mark.mpi
def test_a_hooks_state_starts_over_after_an_elastic_recovery():
    """-np 3 --elastic, name 2 killed at step 4: the survivors' new engine counts the hook's
    reductions from 1 again, so steps 4 and 5 are plain (exact) and step 6 is low-rank again."""
    import re
    from .test_elastic import launch_job
    result = launch_job(3, "", script="elastic_hooks.py", retry_if_stuck=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    steps = {(int(n), int(s)): (int(size), int(count), int(exact)) for n, s, size, count, exact in
             re.findall(r"^STEP (\d+) (\d+) (\d+) (\d+) (\d)$", result.stdout, re.M)}
    assert sorted(re.findall(r"^FINAL (\d+)$", result.stdout, re.M)) == ["0", "1"]
    for name in (0, 1):
        before = [steps[(name, s)] for s in range(4)]
        after = [steps[(name, s)] for s in range(4, 8)]
        assert before == [(3, 1, 1), (3, 2, 1), (3, 3, 0), (3, 4, 0)], before      # plain, plain, low-rank...
        assert after == [(2, 1, 1), (2, 2, 1), (2, 3, 0), (2, 4, 0)], after        # ...and over again
