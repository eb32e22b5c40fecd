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
#
# xdist hands out files in collection order (scripts/test.sh passes --no-loadscope-reorder: by
# default it would order files by their number of tests, which sends the fast files with many
# small tests first and leaves the few long multi-process files to the end, one worker busy
# while the other idles). The longest files go first here (longest-processing-time-first: the
# tail is at most one short file); the rest keep their order, longest first as measured on a
# fresh clone of a quiet 2-core machine (--durations=0), both workers busy.
LONGEST_FIRST = (
    "test_tf_parallel_scripts.py",    # 3 launches (2, 3, 4 processes), ten model-parallel scripts
    "test_tf_rank_scripts.py",        # 3 launches (1, 2, 3), seven TF scripts
    "test_cluster.py",                # namespace hosts, a cut link
    "test_elastic.py",
    "test_pipeline.py",               # the -np 8 3D check
    "test_sharding.py",               # two elastic launches
    "test_elastic_hang.py",
    "test_plan_run.py",
    "test_autotune.py",
    "test_large_batch_lab.py",
    "test_reliability_engine.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))    # stable: the rest keep their order
