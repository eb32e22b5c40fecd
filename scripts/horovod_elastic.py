"""Horovod's elastic integration worker under ``allreduce-run --elastic`` (scripts/horovod_tests.py --elastic).

::

    python scripts/horovod_tests.py --elastic --keras3

Horovod's ``test/integration/elastic_common.py`` runs its worker
``test/integration/data/elastic_tensorflow2_main.py`` under ``horovodrun`` with
an exit schedule and checks the one line rank 0 logs at each epoch's end. The
scenarios here are its ``test_fault_tolerance_without_scaling`` (twice: the
failing worker raises ``RuntimeError``, or is SIGKILLed) and its
``test_all_ranks_failure``, on one host:

========================  =====================================  ==============================================
scenario                  exit schedule (epoch 1, batch 0)       Horovod's checks
========================  =====================================  ==============================================
exception / kill          start ranks 0 and 1 of 4               3 epoch lines; epoch 0: start rank 0, size 4,
                                                                 rendezvous 1; epochs 1, 2: start rank 2, size 2,
                                                                 rendezvous 2; the job succeeds
all ranks fail            start ranks 0, 1, 2, 3                 the job fails
========================  =====================================  ==============================================

Horovod's test gives two hosts of two slots and fails rank 0; the driver then
blacklists rank 0's host, so its two ranks leave. Here a rank is a process,
not a host: the schedule names both of that host's ranks. Also checked, by the
worker's own arithmetic (it counts its commits in the state's ``commits``
keyword): 10, 21 and 32 at the three epoch ends. Horovod's reset-limit and
host-discovery tests need its driver's host discovery, which MPI's fixed host
list does not have: not run.

The worker runs unchanged but for the module alias and, with ``--keras3``, the
spellings of :data:`horovod_tests.KERAS3_SPELLINGS`; a wrapper sets
``HOROVOD_RANK`` (its ``start_rank``) from Open MPI's rank, and ``psutil``
(its kill mode) is a stand-in that SIGKILLs the process.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

__all__ = ["SCENARIOS", "run_elastic"]

_WRAPPER = '''"""Run Horovod's elastic worker as horovodrun would start it (scripts/horovod_elastic.py)."""
import os
import runpy
import sys

os.environ.setdefault("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
os.environ.setdefault("HOROVOD_HOSTNAME", "localhost")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''

_PSUTIL = '''"""Stand-in for psutil in Horovod's elastic worker: Process(pid).kill() is SIGKILL (scripts/horovod_elastic.py)."""
import os
import signal


class Process:
    def __init__(self, pid):
        self.pid = pid

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
'''

_WANT_OK = [{"epoch": 0, "start_rank": 0, "size": 4, "rendezvous": 1, "commits": 10},
            {"epoch": 1, "start_rank": 2, "size": 2, "rendezvous": 2, "commits": 21},
            {"epoch": 2, "start_rank": 2, "size": 2, "rendezvous": 2, "commits": 32}]

#: name -> (exit mode, start ranks that exit at epoch 1 batch 0, expected epoch lines or None: the job fails)
SCENARIOS = {
    "fault_tolerance_exception": ("exception", [0, 1], _WANT_OK),
    "fault_tolerance_kill": ("kill", [0, 1], _WANT_OK),
    "all_ranks_failure": ("exception", [0, 1, 2, 3], None),
}


def _check(logged: list[dict], want: list[dict] | None, code: int) -> list[str]:
    if want is None:
        return [] if code != 0 else [f"the job succeeded (exit {code}); Horovod's test expects it to fail"]
    problems = [] if code == 0 else [f"allreduce-run exited {code}"]
    if len(logged) != len(want):
        problems.append(f"{len(logged)} epoch lines, want {len(want)}")
    for got, expected in zip(logged, want):
        for key, value in expected.items():
            if got.get(key) != value:
                problems.append(f"epoch {expected['epoch']}: {key}={got.get(key)}, want {value}")
    return problems


def run_elastic(work: Path, worker: Path, env: dict, *, timeout: float, names: list[str] | None = None,
                np_: int = 4) -> dict[str, tuple[str, str, float]]:
    """Run each scenario; returns name -> (verdict, details, seconds). ``work`` holds the alias package."""
    (work / "hvd_elastic_wrapper.py").write_text(_WRAPPER)
    (work / "psutil.py").write_text(_PSUTIL)
    results = {}
    for name in names or list(SCENARIOS):
        mode, ranks, want = SCENARIOS[name]
        logfile = work / f"{name}.log"
        logfile.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "allreduce.run", "--elastic", "-np", str(np_), sys.executable,
               str(work / "hvd_elastic_wrapper.py"), str(worker), "--logfile", str(logfile),
               "--exit-schedule", json.dumps({str((1, 0)): ranks}), "--exit-mode", mode]
        tag = uuid.uuid4().hex
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=dict(env, HVDTESTS_TAG=tag), cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            from horovod_setup import kill_tagged
            kill_tagged(tag)
            out, _ = proc.communicate()
            results[name] = ("hang", out[-1500:], time.monotonic() - start)
            continue
        logged = [json.loads(line) for line in logfile.read_text().splitlines()] if logfile.exists() else []
        problems = _check(logged, want, proc.returncode)
        summary = re.findall(r"allreduce-run: elastic job.*", out)
        detail = "; ".join(problems) if problems else (summary[-1] if summary else "")
        results[name] = ("fail" if problems else "pass",
                         detail + "\n" + "\n".join(json.dumps(d) for d in logged) + "\n" + out[-1500:],
                         time.monotonic() - start)
    return results
