"""Hung, not dead (issue 45): a silent rank is evicted and the job goes on; faults inside a recovery.

Two launches of ``tests/mpi/elastic_train.py`` under ``allreduce-run --elastic --max-np N``,
each with a short hang bound (``ALLREDUCE_ELASTIC_HANG_TIMEOUT``) so the suite does not wait:

* -np 4: a short chaos cycle (``benchmarks/elastic_chaos.py``): a SIGKILL, an exception,
  a SIGSTOP for good (hang), and between them a 2 s SIGSTOP/SIGCONT (slow, not hung), each
  fault on a random rank followed by a regrow. The final state equals the numpy replay of the
  committed lineage, bitwise, on every rank; the hung rank is evicted, named in the
  launcher's last line with why and after how long; the slow one is not; the first step after
  the eviction comes within the bound + 5 s of the hang.
* -np 3: a hang (timed the same way), then faults in the middle of recoveries: the replacement
  dies inside its first sync; in that recovery a survivor stops (SIGSTOP) inside
  ``MPI_Comm_shrink`` and is evicted there; rank 0 raises inside a reset callback. Each
  recovers; the job finishes at 3 with the replayed state.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from benchmarks import elastic_chaos
from tests.harness import kill_tagged, mpi_env
from tests.test_elastic import _launch as elastic_launch

BOUND = 4.0             # seconds without a heartbeat before an eviction (short: the suite waits it out)
SLACK = 5.0             # the goal: hang -> first step after the eviction <= BOUND + 5 s
TIMEOUT = 240.0         # under pytest-timeout's 300 s, so the launch is killed and its output shown


def _launch(np_: int, env: dict, *, max_np: int | None = None) -> subprocess.CompletedProcess:
    """test_elastic's launch (a timeout fails the test, naming the command) with the hang bound set."""
    grow = ["--max-np", str(np_ if max_np is None else max_np)] if max_np != 0 else []
    return elastic_launch(np_, env.get("ELASTIC_KILLS", ""), *grow, timeout=TIMEOUT,
                          env={"ALLREDUCE_ELASTIC_HANG_TIMEOUT": f"{BOUND:g}", **env})


def _summary(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("allreduce-run: elastic job")]
    assert lines, stderr[-4000:]
    return lines[-1]


def _assert_evicted(summary: str, name: int, *, count: int = 1) -> None:
    """The launcher's last line names the evicted rank both ways (rank now, name), why, and after how long."""
    found = re.search(rf"evicted rank \d+ of \d+ \(name {name}, pid \d+ on \S+\) with SIGKILL: no heartbeat for "
                      r"([\d.]+) s \(stopped, hung or swapping; the bound is elastic_hang_timeout, ", summary)
    assert found, summary
    assert BOUND <= float(found.group(1)) < BOUND + 2, summary
    assert len(re.findall(r"evicted rank", summary)) == count, summary


def _hang_to_first_step(stdout: str) -> float:
    hang = float(re.search(r"^HANG \d+ step \d+ at ([\d.]+)$", stdout, re.M).group(1))     # the first hang
    after = [float(t) for t in re.findall(r"^RESUMED \d+ ([\d.]+)$", stdout, re.M) if float(t) > hang]
    assert after, stdout[-3000:]
    return after[0] - hang


def test_chaos_cycle_kill_raise_hang_and_a_slow_rank_at_np_4():
    faults = elastic_chaos.plan(4, 3, seed=1, slow=True)         # kill, raise, slow, hang
    assert [f[0] for f in faults] == ["kill", "raise", "slow", "hang"]
    tag = mpi_env()["ALLREDUCE_TEST_TAG"]
    try:
        result = elastic_chaos.launch(4, faults, bound=BOUND, timeout=TIMEOUT,
                                      env={"ALLREDUCE_TEST_TAG": tag, **{k: v for k, v in mpi_env().items()
                                                                         if k.startswith(("OMPI_", "PRTE_"))}})
    except TimeoutError as exc:
        kill_tagged(tag)
        pytest.fail(f"TIMEOUT: the chaos cycle at -np 4: {exc}")
    rows, problems = elastic_chaos.check(4, faults, result)
    assert not problems, f"{problems}\n{result.stdout[-2000:]}\n{result.stderr[-5000:]}"
    print(elastic_chaos.table(rows))
    summary = _summary(result.stderr)
    hang = next(r for r in rows if r["kind"] == "hang")
    _assert_evicted(summary, hang["name"])
    assert "CONTINUED" in result.stdout                            # the slow rank went on, in the job
    assert hang["step_s"] is not None and hang["step_s"] <= BOUND + SLACK, rows
    assert _hang_to_first_step(result.stdout) <= BOUND + SLACK
    for stray in ("\0", "LAUNCHER JOB OBJECT NOT FOUND"):
        assert stray not in result.stderr


def test_hang_at_np_3_then_faults_inside_recoveries():
    # name 2 hangs at step 3 (evicted); replacement 3 dies inside its first sync; in that recovery
    # name 1 stops (SIGSTOP) as it enters MPI_Comm_shrink (evicted there); name 0, alone, grows
    # back (names 4, 5) and raises inside that regrow's reset callback (its 4th); 4 and 5 recover
    # without it and grow back to 3 (name 6)
    result = _launch(3, {"ELASTIC_KILLS": "2@3:hang,3@-2:sync", "ELASTIC_STOP_IN": "1:MPI_Comm_shrink:2",
                         "ELASTIC_RESET_RAISES": "0@4", "ELASTIC_STEPS": "15"})
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    summary = _summary(result.stderr)
    _assert_evicted(summary, 2, count=2)
    _assert_evicted(summary, 1, count=2)
    assert _hang_to_first_step(result.stdout) <= BOUND + SLACK
    assert "HANG 1 in MPI_Comm_shrink" in result.stdout and "RAISE 0 reset 4" in result.stdout, text[-3000:]
    assert re.search(r"rank 0 of 3 \(name 0\) failed with RuntimeError: reset callback raised on name 0 at reset 4",
                     summary), summary
    died = sorted(int(n) for n in re.findall(r"\(name (\d+)\)(?=[^;]* died at)", summary))
    assert died == [0, 1, 2, 3], summary                           # 1 and 3 in one shrink
    assert summary.startswith("allreduce-run: elastic job finished with 3 of 3 ranks"), summary
    finals = re.findall(r"^FINAL (\d+) (\d+) (\w+) (\w+) ([\d,]+) resets=", result.stdout, re.M)
    assert sorted(int(f[0]) for f in finals) == [4, 5, 6] and len({f[1:] for f in finals}) == 1, text[-4000:]
    sizes = [int(n) for n in finals[0][4].split(",")]
    w, v = elastic_chaos.replay(sizes)
    assert (w.tobytes().hex(), v.tobytes().hex()) == finals[0][2:4], "state differs from the replay"


def test_a_timed_out_wait_or_a_stall_blames_the_silent_rank_not_the_waiting_ones():
    # -np 3, no regrow. Name 1 sleeps for good in its loop (its heartbeat thread runs on: only the
    # waits see it): ranks 0 and 2 time out (ALLREDUCE_TIMEOUT=5); one of them may wait on the other
    # (a chain), which the table shows waiting: then the rank of the node that is not waiting, name 1,
    # is blamed. Then name 2 sleeps between
    # the direct and the named allreduce: its engine goes on, name 0's named allreduce fails with
    # StallError after stall_shutdown_time (4 s), which blames name 2. Before issue 45 the waiting
    # ranks raised and left the job.
    result = _launch(3, {"ELASTIC_KILLS": "1@2:deadlock,2@7:stall", "ELASTIC_STEPS": "10", "ALLREDUCE_TIMEOUT": "5",
                         "ALLREDUCE_STALL_SHUTDOWN_TIME": "4"}, max_np=0)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    summary = _summary(result.stderr)
    # whichever survivor timed out first names it: waiting on it directly, or on the other survivor
    assert re.search(r"evicted rank 1 of 3 \(name 1, pid \d+ on \S+\) with SIGKILL: did not answer (for 5 s "
                     r"\(ALLREDUCE_TIMEOUT: TransportTimeoutError waiting for it\)|while the others waited)", summary), summary
    assert re.search(r"evicted rank 1 of 2 \(name 2, pid \d+ on \S+\) with SIGKILL: never submitted a tensor the "
                     r"others did, within stall_shutdown_time \(4 s", summary), summary
    assert len(re.findall(r"evicted rank", summary)) == 2, summary
    assert summary.startswith("allreduce-run: elastic job finished with 1 of 3 ranks"), summary
    finals = re.findall(r"^FINAL (\d+) (\d+) (\w+) (\w+) ([\d,]+) resets=", result.stdout, re.M)
    assert [f[0] for f in finals] == ["0"], text[-3000:]
    w, v = elastic_chaos.replay([int(n) for n in finals[0][4].split(",")])
    assert (w.tobytes().hex(), v.tobytes().hex()) == finals[0][2:4], "state differs from the replay"


def test_eviction_lines_the_launcher_and_the_stray_open_mpi_text(tmp_path):
    from allreduce import errors
    from allreduce.elastic import evict, launch
    from allreduce.run import _clean
    from allreduce.transport.liveness import silent_peer
    line = ("allreduce-elastic: evict rank 1 of 4 (name 5, pid 999999999 on vm, start 123): no heartbeat for "
            "4.1 s (stopped, hung or swapping; the bound is elastic_hang_timeout, 4 s, X); seen by rank 0 (name 0)\n")
    wanted = evict.parse(line)
    assert (wanted.rank, wanted.size, wanted.name, wanted.pid, wanted.host, wanted.start) == (1, 4, 5, 999999999, "vm", 123)
    evictor = evict.Evictor()
    done = evictor.feed(line)                         # no such process: nothing is killed, said so
    assert done is not None and not done.killed and evictor.feed(line) is None   # a repeat is ignored
    # a live process whose start time does not match is never killed (a reused pid)
    child = subprocess.Popen(["sleep", "30"])
    try:
        other = line.replace("999999999", str(child.pid))
        assert not evictor.feed(other).killed and child.poll() is None
        right = other.replace("start 123", f"start {evict.start_time(child.pid)}")
        assert evictor.feed(right).killed and child.wait(5) == -signal.SIGKILL
    finally:
        child.kill()
    summary = launch.Summary(4)
    summary.feed(f"{evict.EVICTED}{evictor.done[-1].describe()}\n")
    summary.feed("allreduce-elastic: rank 1 of 4 (name 5) died (noticed at 09:17:56.956 UTC); going on with 3 of 4 ranks")
    summary.feed("allreduce-elastic: run(train) finished with 3 ranks (started with 4)")
    text, code = summary.report(0)
    assert code == 0 and re.search(r"finished with 3 of 4 ranks; evicted rank 1 of 4 \(name 5, pid \d+ on vm\) with "
                                   r"SIGKILL: no heartbeat for 4.1 s .*; rank 1 of 4 \(name 5\) died at 09:17:56.956 UTC$", text), text
    assert _clean("LAUNCHER JOB OBJECT NOT FOUNDallreduce-run: x\n") == "allreduce-run: x\n"
    assert _clean("LAUNCHER JOB OBJECT NOT FOUND") == "" and _clean("a\0b\n") == "ab\n"
    timeout = errors.TransportTimeoutError("rank 1: no progress for 3 s waiting to receive from rank 2, send to rank 0")
    assert silent_peer(timeout) == 2 and silent_peer(RuntimeError("x")) is None
    try:
        raise errors.AllreduceError("engine failed") from timeout
    except errors.AllreduceError as wrapped:
        assert silent_peer(wrapped) == 2
    key = launch.environment(launch.ElasticOptions(), {})["ALLREDUCE_ELASTIC_JOB"]
    assert key == f"{os.getpid()}-{evict.start_time(os.getpid())}"
    # the tables of launchers that are gone are removed at the next start; a live one's and a user's key stay
    shm = tmp_path
    gone = subprocess.Popen(["true"])
    gone.wait()
    names = [f"allreduce-elastic-{gone.pid}-{12345}.vm.beat", f"allreduce-elastic-{os.getpid()}-1.10_0_0_2.beat",
             f"allreduce-elastic-{key}.vm.beat", "allreduce-elastic-my-job.vm.beat"]
    for n in names:
        (shm / n).write_bytes(b"")
    assert sorted(evict.remove_stale(str(shm))) == sorted(str(shm / n) for n in names[:2])
    assert sorted(p.name for p in shm.iterdir()) == sorted(names[2:])
    # the majority rule of a cut link (partition.py), and a host counts as silent only when all its ranks are
    from allreduce.elastic import partition
    assert partition.goes_on(2, 4, with_rank_0=True) and not partition.goes_on(2, 4, with_rank_0=False)
    assert partition.goes_on(2, 3, with_rank_0=False) and not partition.goes_on(1, 3, with_rank_0=True)
    assert partition.goes_on(3, 5, with_rank_0=False) and not partition.goes_on(2, 5, with_rank_0=True)
    book, heard = {2: ("b", ("10.0.0.2", 1)), 3: ("b", ("10.0.0.2", 2)), 4: ("c", ("10.0.0.3", 3))}, \
        {2: 90.0, 3: 99.0, 4: 90.0}
    try:
        partition._book, partition._heard = book, heard
        assert partition._silent_hosts(100.0, 4.0) == set()              # never heard: not judged
        partition._ever.update({2, 3, 4})
        assert partition._silent_hosts(100.0, 4.0) == {"c"}            # b's rank 3 still beats
        heard[3] = 95.0
        assert partition._silent_hosts(100.0, 4.0) == {"b", "c"}
        partition._done.add(4)                                         # c's rank finished: not silent
        assert partition._silent_hosts(100.0, 4.0) == {"b"}
    finally:
        partition._book, partition._heard = {}, {}
        partition._done.clear()
        partition._ever.clear()
    # an mpirun still running past the launcher's deadline (after a cut, after the watchdog's abort) is ended
    import time

    from allreduce import run
    stuck = subprocess.Popen(["sleep", "60"], start_new_session=True)
    began = time.monotonic()
    assert run._wait(stuck, {"at": began + 0.3, "why": "test"}) == -signal.SIGTERM
    assert time.monotonic() - began < 3
    assert evict.table_path({"ALLREDUCE_ELASTIC_JOB": "12-3"}, "10.0.0.2") == "/dev/shm/allreduce-elastic-12-3.10_0_0_2.beat"
    assert evict.table_path({"PMIX_NAMESPACE": "prterun-vm-77@2"}, "vm") == "/dev/shm/allreduce-elastic-prterun-vm-77.vm.beat"
