"""Elastic training (issue 25): ranks SIGKILLed in every phase, survivors shrink and go on.

Each launch runs ``tests/mpi/elastic_train.py`` under ``allreduce-run --elastic``
with a list of kill points (name, step, phase): 21 points in five launches, the
last one with ``--max-np`` (the world grows back after every death). The checks,
for every launch:

* the launcher exits 0 and its summary names every dead and joined rank and the final size;
* every survivor prints its final state: exactly the expected survivors, bitwise
  identical, and equal to a numpy replay of the committed lineage (SGD with
  momentum; the state records the world size of every step it kept);
* every death was noticed through the death path, well inside any timeout
  (DETECT_BOUND; how fast, on a quiet machine, is ``benchmarks/elastic_bench.py``'s
  ``detection`` column, not a timed test).

Plus: a spawn that fails is said once and the job goes on at its size; below
``--min-np`` every survivor exits non-zero naming the dead rank and the last
commit, and so does the launcher; the launcher's flags and summary parsing; and
(slow: TensorFlow start-up) a Keras ``model.fit`` with the three callbacks.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timezone

import numpy as np
import pytest

from allreduce.elastic import launch
from tests.harness import MPI_SCRIPTS, kill_tagged, mpi_env

#: Seconds from a SIGKILL to the survivors' recovery line. Not a speed goal (that is
#: elastic_bench.py's detection, 0.004-0.09 s in BENCHMARKS.md's runs): a correctness bound, half of the first timeout that
#: could also end the wait (ALLREDUCE_TIMEOUT / the hang bound / STEP_BOUND, 30 s), so a death caught
#: only by a timeout fails. It was 5 s and failed once in CI at 6.19 s under the suite's load (6 ranks
#: on 2 cores beside a TensorFlow launch; stop 48, 2026-12-07).
DETECT_BOUND = 15.0
TIMEOUT = 240.0         # per launch; the machine is shared, and a hang must fail, not hang the suite

_spec = importlib.util.spec_from_file_location("elastic_train", MPI_SCRIPTS / "elastic_train.py")


def _replay(sizes):
    module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(module)
    return module.replay(sizes)


STEP_BOUND = "30"       # ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT here: a rank stuck in a recovery step fails in 30 s


#: Open MPI's own faults after a rank dies, not the library's: the elastic watchdog's "stuck inside
#: Open MPI" (ULFM + tcp deadlock, allreduce/elastic/watchdog.py; 2 in 25 runs of one case before
#: native.py's eager pieces, 0 in 50 after); libnbc aborting a nonblocking schedule after a
#: failure and then the survivor's heap corrupted inside Open MPI (seen once, the fresh-clone suite at
#: 17:35 UTC on 2026-12-07, a parent killed inside MPI_Comm_spawn, under load: "NBC_Progress: an
#: error 75 ...", "corrupted size vs. prev_size", mpirun -6; 0 in 6 runs alone after it); and mpirun
#: itself ended by a signal (the launcher's "mpirun exited with -11"/"-6": Open MPI's runtime, prterun,
#: crashed; no code of ours runs in it. Seen once, the same test in the fresh-clone suite at 19:25 UTC on
#: 2026-12-07 under load, after libevent's "Epoll ADD(4) on fd 17 failed ... Bad file descriptor").
OPEN_MPI_FAULTS = ("stuck inside Open MPI", "NBC_Progress: an error", "(mpirun exited with -11)",
                   "(mpirun exited with -6)")


def launch_job(np_: int, kills: str, *extra: str, retry_if_stuck: bool = False, retries: int = 1,
               **kwargs) -> subprocess.CompletedProcess:
    """One launch; with ``retry_if_stuck``, up to ``retries`` more launches when, and only when, the
    last one failed with one of :data:`OPEN_MPI_FAULTS` in its output. Any other failure, or one such
    fault more than ``retries``, fails the test."""
    result = _launch(np_, kills, *extra, **kwargs)
    for _ in range(retries if retry_if_stuck else 0):
        fault = [line for line in result.stderr.splitlines() if any(f in line for f in OPEN_MPI_FAULTS)]
        if result.returncode == 0 or not fault:
            break
        print(f"RETRY: the launch failed inside Open MPI: {fault[:2]}")
        result = _launch(np_, kills, *extra, **kwargs)
    return result


def _launch(np_: int, kills: str, *extra: str, script: str = "elastic_train.py", env: dict | None = None,
            timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    full = mpi_env()
    full.update({"ELASTIC_KILLS": kills, "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT": STEP_BOUND, **(env or {})})
    cmd = [sys.executable, "-m", "allreduce.run", "--elastic", "-np", str(np_), *extra,
           sys.executable, str(MPI_SCRIPTS / script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_tagged(full["ALLREDUCE_TEST_TAG"])
        out, err = proc.communicate()
        pytest.fail(f"TIMEOUT after {timeout:g} s: {' '.join(cmd)} (ELASTIC_KILLS={kills})\n"
                    f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _seconds_of_day(text: str) -> float:
    h, m, s = text.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


# np, --max-np (0: no regrow), kill points "name@step:phase", the names left at the end, and the
# sizes after each change of the world (every reset callback of a process that lived through all).
# 21 kill points over every phase of the issue, every rank killed in some launch, rank 0 in all
# five; without --max-np four or five deaths one after another (-np 6: down to 2, and to 1 rank);
# with --max-np 4 the world grows back after each death, the replacements (named 4, 5, ...) get
# the state in their first sync and can die too. Step -1: the first sync after a shrink, -2: the
# first after a regrow (a parent dies where the replacement receives the state).
CASES = {
    "rank 0 in ring, sync, mailbox, commit": (6, 0, "0@2:ring,5@-1:sync,3@7:mailbox,1@12:commit", [2, 4],
                                              [5, 4, 3, 2]),
    "compute, rhd, rank 0 in engine, shm": (6, 0, "1@1:compute,4@5:rhd,0@10:engine,2@16:shm", [3, 5],
                                            [5, 4, 3, 2]),
    "tree, rank 0 in commit, rd, shm": (6, 0, "2@2:tree,0@6:commit,5@10:rd,4@14:shm", [1, 3], [5, 4, 3, 2]),
    "mpi, rank 0 in sync, compute, rhd, mailbox: down to 1": (
        6, 0, "4@1:mpi,0@-1:sync,3@8:compute,2@13:rhd,5@17:mailbox", [1], [5, 4, 3, 2, 1]),
    "regrow: engine, rank 0 in the regrow's sync, a replacement in tree, commit": (
        4, 4, "2@2:engine,0@-2:sync,4@10:tree,1@15:commit", [3, 5, 6, 7], [3, 4, 3, 4, 3, 4, 3, 4]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_survivors_restore_the_last_commit_and_finish(case):
    np_, max_np, kills, survivors, changes = CASES[case]
    result = launch_job(np_, kills, *(("--max-np", str(max_np)) if max_np else ()), retry_if_stuck=True)
    text = result.stdout + result.stderr
    assert result.returncode == 0, f"launcher exited {result.returncode}\n{text[-5000:]}"
    finals = re.findall(r"^FINAL (\d+) (\d+) (\w+) (\w+) ([\d,]+) resets=(\[[\d, ]*\]) keys=(\S+)$", result.stdout,
                        re.M)
    assert sorted(int(f[0]) for f in finals) == survivors, text[-5000:]
    assert len({f[1:5] for f in finals}) == 1, "survivors differ (not bitwise identical)"
    _assert_user_keys(finals, commits=8)
    _, size, w_hex, v_hex, sizes_text, _, _ = finals[0]
    sizes = [int(s) for s in sizes_text.split(",")]
    assert int(size) == len(survivors) == sizes[-1] and len(sizes) == 24
    if not max_np:
        assert sizes == sorted(sizes, reverse=True) and sizes[0] <= np_      # the world only shrinks
    else:
        assert set(sizes) == {max_np - 1, max_np}                            # shrinks, grows back
    w, v = _replay(sizes)
    assert w.tobytes().hex() == w_hex and v.tobytes().hex() == v_hex, "state differs from the replay"
    resets = sorted((eval(f[5]) for f in finals), key=len)                   # noqa: S307 - our own output
    assert resets[-1] == changes and all(changes[len(changes) - len(r):] == r for r in resets), resets
    # the launcher's summary: every death and join, by name, and the size at the end
    dead = sorted(int(k.split("@")[0]) for k in kills.split(","))
    summary = [line for line in result.stderr.splitlines() if "allreduce-run: elastic job" in line]
    assert summary and f"finished with {len(survivors)} of {np_} ranks" in summary[-1], summary
    assert sorted(int(r) for r in re.findall(r"\(name (\d+)\)(?=[^;]* died at)", summary[-1])) == dead
    joined = [int(r) for r in re.findall(r"\(name (\d+)\)(?=[^;]* joined at)", summary[-1])]
    assert joined == (list(range(np_, np_ + len(dead))) if max_np else []), summary[-1]
    # detection: each recovery line comes within DETECT_BOUND of its kill
    killed = sorted((float(t), line) for line, t in
                    re.findall(r"^(KILL \d+ step -?\d+ \w+ at ([\d.]+))$", result.stdout, re.M))
    noticed = sorted((_seconds_of_day(t.split()[0]), line) for line, t in
                     re.findall(r"^(.*noticed at ([\d:.]+ UTC).*)$", result.stderr, re.M))
    assert len(killed) == len(noticed) == len(dead), text[-3000:]
    for (kill, kill_line), (seen, seen_line) in zip(killed, noticed):
        day = datetime.fromtimestamp(kill, timezone.utc)
        lag = (seen - (day.hour * 3600 + day.minute * 60 + day.second + day.microsecond / 1e6)) % 86400
        assert lag < DETECT_BOUND, (f"a death was noticed {lag:.2f} s after the kill: {kill_line!r} -> "
                                    f"{seen_line.strip()!r}\n{text[-3000:]}")


def test_a_failed_spawn_is_said_and_the_job_goes_on_at_its_size():
    # two slots on the host mpirun was given: MPI_Comm_spawn fails on both ranks alike
    result = launch_job(2, "", "--max-np", "3", "--host", "localhost:2",
                        env={"ELASTIC_STEPS": "6", "OMPI_MCA_rmaps_base_oversubscribe": "0",
                             "PRTE_MCA_rmaps_default_mapping_policy": "slot"})   # mpi_env's oversubscribe off
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    assert len(re.findall(r"allreduce-elastic: could not spawn 1 replacement", result.stderr)) == 1, text[-4000:]
    assert "finished with 2 of 2 ranks; no rank died; spawning 1 replacement(s) failed" in result.stderr
    finals = re.findall(r"^FINAL (\d+) 2 (\w+) (\w+) ([\d,]+) resets=\[\] keys=commits:2,in_run:r0,rendezvous:2$",
                        result.stdout, re.M)
    assert sorted(int(f[0]) for f in finals) == [0, 1] and len({f[1:] for f in finals}) == 1, text[-4000:]
    w, v = _replay([2] * 6)
    assert (w.tobytes().hex(), v.tobytes().hex()) == finals[0][1:3]


def _assert_user_keys(finals, *, commits: int) -> None:
    """The state's user keywords named like library bookkeeping (elastic_train.py) come out as the user
    left them: its own commit count, rank 0's ``in_run`` (sync), the same ``rendezvous`` everywhere."""
    keys = {f[-1] for f in finals}
    assert len(keys) == 1 and keys.pop().startswith(f"commits:{commits},in_run:r0,rendezvous:"), finals


def _finals(stdout: str) -> list[tuple[str, ...]]:
    return re.findall(r"^FINAL (\d+) (\d+) (\w+) (\w+) ([\d,]+) resets=", stdout, re.M)


@pytest.mark.timeout(2 * TIMEOUT + 30)          # one retry on an Open MPI fault (launch_job)
def test_a_parent_killed_in_mpi_comm_spawn_is_a_death_and_the_world_still_grows_back():
    # -np 3 --max-np 3: rank 2 dies at step 1; at the commit of step 3 the parents spawn, and rank 1
    # dies 0.2 s into MPI_Comm_spawn. Rank 0 shrinks to 1 and grows back to 3 at the next commit;
    # the process started by the broken spawn (stuck in MPI_Init) ends at the step bound.
    # Killing a process inside MPI_Comm_spawn is the case Open MPI itself survives least (2 of its
    # faults in 7 suite runs on 2026-12-07, none of ours): two retries on those faults alone
    result = launch_job(3, "2@1:compute,1@3:spawn", "--max-np", "3", retry_if_stuck=True, retries=2,
                        env={"ELASTIC_STEPS": "9", "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT": "8"})
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    summary = [line for line in result.stderr.splitlines() if "allreduce-run: elastic job" in line]
    assert summary and "finished with 3 of 3 ranks; rank 2 of 3 (name 2) died at" in summary[-1], text[-4000:]
    assert "rank 1 of 2 (name 1) died at" in summary[-1] and "rank 1 of 3 (name 4), rank 2 of 3 (name 5) joined at" in summary[-1], summary[-1]
    finals = _finals(result.stdout)
    assert sorted(int(f[0]) for f in finals) == [0, 4, 5] and len({f[1:] for f in finals}) == 1, text[-4000:]
    sizes = [int(n) for n in finals[0][4].split(",")]
    assert sizes[:3] == [2, 2, 2] and 1 in sizes and sizes[-1] == 3, sizes    # 2, then 1, then 3 ranks
    w, v = _replay(sizes)
    assert (w.tobytes().hex(), v.tobytes().hex()) == finals[0][2:4]


def test_a_replacement_that_dies_before_its_merge_is_a_failed_spawn(tmp_path):
    # -np 2 --max-np 3 grows at its first commit; the replacement SIGKILLs itself before it merges.
    # Open MPI never tells parents waiting in the merge: they wait for its "ready" with a deadline.
    result = launch_job(2, "", "--max-np", "3", env={"ELASTIC_STEPS": "6", "ELASTIC_JOIN_DIE": str(tmp_path / "died"),
                                                     "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT": "4"})
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    assert "KILL join before merge" in result.stdout, text[-3000:]
    said = re.findall(r"allreduce-elastic: could not spawn 1 replacement\(s\) \(a replacement was not ready "
                      r"to join within 4 s", result.stderr)
    assert len(said) == 1, text[-4000:]
    assert "finished with 2 of 2 ranks; no rank died; spawning 1 replacement(s) failed" in result.stderr
    finals = _finals(result.stdout)
    assert sorted(int(f[0]) for f in finals) == [0, 1] and len({f[1:] for f in finals}) == 1, text[-4000:]
    w, v = _replay([2] * 6)
    assert (w.tobytes().hex(), v.tobytes().hex()) == finals[0][2:4]


def test_a_rank_stuck_inside_mpi_in_a_recovery_step_aborts_the_job_naming_the_step():
    # rank 1 dies; rank 2 then blocks inside MPI as it enters MPI_Comm_shrink (a receive nobody
    # sends: what Open MPI's ULFM + tcp deadlock looks like). The watchdog's bound (2 s) ends the job.
    result = launch_job(3, "1@1:compute", env={"ELASTIC_STEPS": "6", "ELASTIC_STUCK": "2:MPI_Comm_shrink",
                                               "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT": "2"}, timeout=90)
    text = result.stdout + result.stderr
    assert result.returncode == launch.STUCK_EXIT, f"launcher exited {result.returncode}\n{text[-4000:]}"
    assert "STUCK 2 in MPI_Comm_shrink" in result.stdout, text[-3000:]
    # rank 0 waits in MPI_Comm_shrink for rank 2 under the same bound: whichever watchdog fires
    # first names itself (rank 0's did in 1 of 3 launches on the loaded VM)
    assert re.search(r"allreduce-elastic: rank \d of \d \(name [02]\) stuck inside Open MPI in MPI_Comm_shrink for \d+ s "
                     r"\(Open MPI's ULFM over tcp can deadlock", result.stderr), text[-4000:]
    summary = [line for line in result.stderr.splitlines() if "allreduce-run: elastic job" in line]
    assert summary and "allreduce-run: elastic job aborted: stuck inside Open MPI: rank" in summary[-1], summary
    assert re.search(r"\(name [02]\) in MPI_Comm_shrink for", summary[-1]), summary[-1]
    assert "FINAL" not in result.stdout


def test_below_min_np_every_survivor_stops_naming_the_dead_and_the_commit():
    result = launch_job(3, "1@4:ring", "--min-np", "3")
    assert result.returncode != 0
    stops = [line for line in result.stderr.splitlines() if "below --min-np 3" in line and "allreduce-elastic" in line]
    assert len(stops) == 2, result.stderr[-4000:]                 # both survivors
    for line in stops:
        assert "rank 1 of 3 (name 1) died" in line and "commit 1 (step=3, commits=1, in_run=r0, rendezvous=1)" in line, line
    assert "elastic job stopped below --min-np" in result.stderr
    assert "FINAL" not in result.stdout


def test_launcher_flags_and_summary():
    rest, options = launch.split_flags(["--elastic", "--min-np", "2", "--max-np", "5", "--mca", "x", "y"])
    assert rest == ["--mca", "x", "y"] and (options.min_np, options.max_np) == (2, 5)
    assert launch.split_flags(["--mca", "x", "y"]) == (["--mca", "x", "y"], None)
    with pytest.raises(SystemExit, match="add --elastic"):
        launch.split_flags(["--min-np", "2"])
    with pytest.raises(SystemExit, match="more than -np"):
        launch.mpirun_flags(options, 1, [])
    assert launch.mpirun_flags(options, 4, []) == ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]
    assert launch.mpirun_flags(options, 4, ["--mca", "btl", "self,tcp"]) == ["--with-ft", "ulfm"]
    with pytest.raises(SystemExit, match="--max-np 5 is less than -np 6"):
        launch.mpirun_flags(options, 6, [])
    # room for replacements above the cores (at -np above the cores run.py adds it itself)
    assert launch.mpirun_flags(options, 2, [], cores=2)[2:5] == ["--oversubscribe", "--bind-to", "none"]
    assert "--oversubscribe" not in launch.mpirun_flags(options, 3, [], cores=2)
    assert "--oversubscribe" not in launch.mpirun_flags(options, 2, ["-H", "a:2"], cores=2)
    env = launch.environment(options, {})
    assert env["ALLREDUCE_ELASTIC"] == "1" and env["ALLREDUCE_ELASTIC_MIN_NP"] == "2"
    assert env["ALLREDUCE_SHM_P2P"] == "1" and "ALLREDUCE_SHM_P2P" not in launch.environment(options, {"ALLREDUCE_SHM_P2P": "0"})
    summary = launch.Summary(4)
    summary.feed("allreduce-elastic: rank 2 of 4 (name 2) died (noticed at 09:17:56.956 UTC); going on with 3 of 4 ranks")
    assert summary.report(1) == ("allreduce-run: elastic job did not finish (mpirun exited with 1); "
                                 "rank 2 of 4 (name 2) died at 09:17:56.956 UTC", 1)
    summary.feed("allreduce-elastic: run(train) finished with 3 ranks (started with 4)")
    assert summary.report(0)[1] == 0 and "finished with 3 of 4 ranks" in summary.report(0)[0]
    summary.feed("allreduce-elastic: rank 3 of 4 (name 4) joined (spawned at 09:18:01.5 UTC); going on with 4 of 4 ranks")
    assert summary.report(0)[0].endswith("rank 2 of 4 (name 2) died at 09:17:56.956 UTC; rank 3 of 4 (name 4) joined "
                                         "at 09:18:01.5 UTC")
    summary.feed("allreduce-elastic: below --min-np 3: ...")
    assert summary.report(0)[1] == launch.BELOW_MIN_EXIT
    stuck = launch.Summary(3)
    stuck.feed("allreduce-elastic: rank 1 (name 2) stuck inside Open MPI in MPI_Comm_shrink for 30 s (...)")
    text, code = stuck.report(137)
    assert code == 137 and text.startswith("allreduce-run: elastic job aborted: stuck inside Open MPI: "
                                           "rank 1 (name 2) in MPI_Comm_shrink for 30 s"), text
    assert stuck.report(0)[1] == launch.STUCK_EXIT


@pytest.mark.slow
def test_keras_fit_with_the_three_callbacks_survives_a_death_and_a_raise_and_grows_back():
    # rank 2 is SIGKILLed at epoch 1 batch 5, replacement 3 joins; rank 0's callback raises at epoch 2
    # batch 3 (issue 35: it leaves as after a death), replacement 4 joins
    result = launch_job(3, "", "--max-np", "3", script="elastic_keras.py",
                        env={"ELASTIC_KERAS_KILL": "2@1:5", "ELASTIC_KERAS_RAISE": "0@2:3", "TF_CPP_MIN_LOG_LEVEL": "2"})
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-5000:]
    finals = re.findall(r"^KERAS (\d+) (\d+) epoch=(\d+) (\w+)$", result.stdout, re.M)
    assert sorted(int(f[0]) for f in finals) == [1, 3, 4], text[-5000:]     # 3, 4: the replacements
    assert len({f[1:] for f in finals}) == 1, "survivors' and replacements' weights differ"
    assert finals[0][1] == "3" and finals[0][2] == "3"
    assert "RESTORED-OK" in result.stdout and "RESTORED-WRONG" not in result.stdout
    summary = [line for line in result.stderr.splitlines() if "allreduce-run: elastic job" in line]
    assert summary and re.search(r"allreduce-run: elastic job finished with 3 of 3 ranks; rank 2 of 3 \(name 2\) died at \S+ UTC; "
                                r"rank 2 of 3 \(name 3\) joined at \S+ UTC; rank \d of 3 \(name 0\) failed with RuntimeError: "
                                r"callback raised on name 0 at epoch 2 batch 3; rank \d of 3 \(name 0\) died at \S+ UTC; "
                                r"rank 2 of 3 \(name 4\) joined at",
                                summary[-1]), summary
