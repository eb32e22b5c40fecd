import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Root in CI and on dev machines: Open MPI refuses root without these.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

# Property tests: random examples on a developer's machine (to find new cases), the same
# examples on every CI run (a red CI then means a change broke something, not a new draw).
try:
    from hypothesis import settings as _hypothesis_settings
    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:
    pass



# The suite runs on two pytest-xdist workers, a whole test file to one worker (scripts/test.sh:
# -n 2 --dist loadfile): the many multi-process tests that mostly wait (timeouts, recoveries,
# spawns) overlap, and the tests of one file never run at once (tests/test_cluster.py's fixed
# namespace names). --dist loadgroup would be finer, but with pytest 9 its xdist_group marks are
# not applied (seen with pytest-xdist 3.8: the cluster tests ran on both workers).
