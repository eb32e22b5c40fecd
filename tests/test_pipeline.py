"""tfops.parallel.Pipeline (issue 43) under mpirun: ONE launch at -np 2 and ONE at -np 4.

tests/mpi/pipeline_check.py (its docstring lists the checks) compares every schedule x m x
optimizer with the one-process model trained on the full batch in the same launch, checks the
MismatchError of bad shapes/dtypes/batches on every rank, model.fit and the timeline's spans.
The schedules themselves are tested without TensorFlow in test_pipeline_schedules.py.
"""
import pytest

from .harness import TF_ENV, mpirun

pytest.importorskip("tensorflow")

TIMEOUT = 600                       # a launch: TF's import alone takes tens of seconds on a loaded 2-core machine


@pytest.mark.mpi
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("np_", [2, 4])
def test_pipeline_equals_one_process(np_, tmp_path):
    text = mpirun(np_, "pipeline_check.py", str(tmp_path), timeout=TIMEOUT, env=TF_ENV).stdout
    for r in range(np_):
        assert f"rank {r}: pipeline_check OK" in text, text[-3000:]
