"""A communication hook under ``--elastic`` (issue 32): its state is reset by a recovery.

tests/mpi/elastic_hook.py (its docstring says how): one PowerSGD hook per rank, a death at step 5,
and the survivors' first step after the recovery reduces exactly as a new hook would (no error
feedback, warm start or step count from before), where before the death it did not.
"""
from __future__ import annotations

import pytest

from tests.test_elastic import launch_job

pytestmark = pytest.mark.mpi


def test_a_hooks_state_is_reset_after_a_recovery():
    result = launch_job(3, "", script="elastic_hook.py", retry_if_stuck=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("HOOK")) == \
        ["HOOK 0 before-differs reset-ok", "HOOK 1 before-differs reset-ok"], result.stdout[-2000:]
    assert "rank 2 of 3 (name 2) died" in result.stderr + result.stdout
