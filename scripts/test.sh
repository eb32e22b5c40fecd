#!/usr/bin/env bash
# Set everything up on a fresh machine, then run the whole test suite.
#   bash scripts/test.sh            # what CI runs (.ci/run)
#   bash scripts/test.sh -k ring    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
export PATH="$PWD/.venv/bin:$PATH"
# Two workers (pytest-xdist), a test file to one worker: the multi-process tests that mostly wait overlap, and
# a file whose tests share fixed names (test_cluster.py: namespaces) stays on one worker. ALLREDUCE_TEST_WORKERS=0: serial.
WORKERS=${ALLREDUCE_TEST_WORKERS:-2}
XDIST=(); [ "$WORKERS" != 0 ] && XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)   # order: tests/conftest.py
exec .venv/bin/python -m pytest -q -ra --durations=25 "${XDIST[@]}" "$@"   # the 25 slowest: the suite must stay under 12 min
