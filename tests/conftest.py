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


# The suite runs on two pytest-xdist workers (scripts/test.sh: -n 2 --dist loadgroup): the many
# multi-process tests that mostly wait (timeouts, recoveries, spawns) overlap. What cannot share the
# machine with another test at once is grouped onto one worker, one test after the other:
# - "netns": the namespace cluster (allreduce-cluster up/down makes and removes fixed names).
_GROUPS = {"netns": ("test_cluster.py",)}


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        for group, files in _GROUPS.items():
            if item.path.name in files or "cluster" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))
