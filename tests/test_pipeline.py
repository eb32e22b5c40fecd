"""tfops.parallel.Pipeline (issue 43) under mpirun: the -np 8 3D check.

tests/mpi/pipeline_check.py (its docstring lists the checks; it runs at -np 2 and 4 in
tests/test_tf_parallel_scripts.py's launches, several rank scripts to a launch) compares every
schedule, at every m, with each optimizer, with the one-process model trained on the full batch in
the same launch, checks the MismatchError of bad shapes/dtypes/batches on every rank, model.fit and the timeline's spans.
The -np 8 launch is the 3D check: tests/mpi/pipeline_gpt_check.py --lean trains examples/gpt.py's
GPT on Mesh(tensor=2, pipeline=2) with data 2 (1f1b, 3 Adam steps) against the plain one-process
GPT. The schedules themselves are tested without TensorFlow in test_pipeline_schedules.py.
"""
import pytest

from .harness import TF_ENV, mpirun

pytest.importorskip("tensorflow")

TIMEOUT = 600                       # a launch: TF's import alone takes tens of seconds on a loaded 2-core machine


@pytest.mark.mpi
@pytest.mark.timeout(TIMEOUT + 30)
def test_pipeline_3d_gpt_equals_one_process():
    text = mpirun(8, "pipeline_gpt_check.py", "2", "2", "--lean", timeout=TIMEOUT, env=TF_ENV).stdout
    for r in range(8):
        assert f"rank {r}: pipeline_gpt_check OK" in text, text[-3000:]
