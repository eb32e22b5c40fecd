"""A broken rank fails the whole job, quickly and clearly, through the launcher.

Each case runs ``allreduce-run -np 2 python tests/mpi/fault_job.py MODE``
under a hard timeout and checks: non-zero exit, within the bound, and a
message that names the broken rank.
"""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from .harness import MPI_SCRIPTS, kill_tagged, mpi_env

BOUND = 30.0   # seconds: the documented bound for the surviving ranks to exit


def launch(*args, env=None, **kw):
    cmd = [sys.executable, "-m", "allreduce.run", "-np", "2", sys.executable, str(MPI_SCRIPTS / "fault_job.py"),
           *args]
    full = mpi_env()
    full.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full,
                            start_new_session=True, **kw)
    proc.tag = full["ALLREDUCE_TEST_TAG"]
    return proc


def finish(proc, timeout=90.0):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_tagged(proc.tag)
        out, _ = proc.communicate()
        pytest.fail(f"TIMEOUT: the job did not end within {timeout} s\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["raise", "exit", "kill"])
def test_broken_rank_ends_the_job(mode):
    start = time.monotonic()
    code, out = finish(launch(mode))
    elapsed = time.monotonic() - start
    assert code != 0, out
    assert "UNREACHABLE" not in out
    assert elapsed < BOUND + 15, f"took {elapsed:.0f} s"     # + start-up of 2 Python processes
    assert "rank 1" in out, out[-2000:]
    if mode == "raise":
        assert "rank 1 of 2 failed with ValueError: boom in user code" in out, out[-2000:]


@pytest.mark.mpi
def test_silent_rank_times_out_and_names_the_peer():
    start = time.monotonic()
    code, out = finish(launch("silent", env={"ALLREDUCE_TIMEOUT": "3"}))
    assert code != 0
    assert time.monotonic() - start < BOUND + 15
    assert "rank 0: no progress for 3 s" in out and "rank 1" in out, out[-2000:]


def _alive(tag: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
    return [pid for pid in found if int(pid) != os.getpid()]


@pytest.mark.mpi
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_launcher_stops_every_rank(signum):
    tag = f"faulttag{uuid.uuid4().hex[:8]}"
    proc = launch("loop", tag)
    ready = 0
    deadline = time.monotonic() + 60
    while ready < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        ready += "ready" in line
    assert ready == 2, "ranks never started"
    proc.send_signal(signum)
    code, out = finish(proc, timeout=40)
    assert code != 0
    time.sleep(0.5)
    assert _alive(tag) == [], f"orphans left: {_alive(tag)}"
