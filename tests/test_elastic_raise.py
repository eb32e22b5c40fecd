"""Elastic training (issue 35): a rank whose training function raises leaves, the others go on.

Launches of ``tests/mpi/elastic_train.py`` under ``allreduce-run --elastic`` with
``ELASTIC_RAISES`` (name@step:phase, see that script):

* one launch, three ranks raising one after another, in the three phases
  (compute; between two collectives while the others wait in the second;
  half-way through a commit), rank 0 first: the last rank finishes alone, its
  state equal to the numpy replay of the committed lineage, the launcher exits
  0 and names every rank that raised with its exception's first line;
* every rank raising: the job ends non-zero, naming each;
* ``--reset-limit 1``: the first death is recovered, the second ends the job
  on every survivor, naming the limit (exit 5).

Keras ``model.fit`` with the elastic callbacks and a callback that raises on
rank 0 shares the Keras launch of tests/test_elastic.py (TensorFlow's start-up
is the cost of such a launch).

Plus, without MPI: the launcher's flags and summary lines, and every keyword of
an ``ObjectState``, whatever its name, through commit, restore and sync.
"""
from __future__ import annotations

import pickle
import re
import time

import numpy as np
import pytest

from allreduce.elastic import ObjectState, launch, state as state_module
from tests.test_elastic import _assert_user_keys, _replay, launch_job

FINAL = re.compile(r"^FINAL (\d+) (\d+) (\w+) (\w+) ([\d,]+) resets=(\[[\d, ]*\]) keys=(\S+)$", re.M)


def _summary(stderr: str) -> str:
    # the launcher's last line (Open MPI's runtime may have left text without a newline before it)
    lines = [line[line.index("allreduce-run: elastic job"):] for line in stderr.splitlines()
             if "allreduce-run: elastic job" in line]
    assert lines, stderr[-4000:]
    return lines[-1]


def _failed(name: int, step: int, phase: str) -> str:
    return f"(name {name}) failed with RuntimeError: check_rank and exit: name {name} at step {step} in {phase}"


def test_ranks_that_raise_in_each_phase_leave_and_the_last_finishes():
    result = launch_job(4, "", env={"ELASTIC_RAISES": "0@2:compute,2@5:collective,1@9:commit", "ELASTIC_STEPS": "12"},
                        retry_if_stuck=True)
    text = result.stdout + result.stderr
    assert result.returncode == 0, f"launcher exited {result.returncode}\n{text[-5000:]}"
    finals = FINAL.findall(result.stdout)
    assert [f[0] for f in finals] == ["3"] and finals[0][1] == "1", text[-5000:]
    sizes = [int(n) for n in finals[0][4].split(",")]
    assert sizes == [3] * 3 + [2] * 6 + [1] * 3, sizes          # back to the commits of steps 0, 3 and 9
    w, v = _replay(sizes)
    assert (w.tobytes().hex(), v.tobytes().hex()) == finals[0][2:4], "state differs from the replay"
    assert finals[0][5] == "[3, 2, 1]", finals                  # a reset per rank that left
    _assert_user_keys(finals, commits=4)
    # each rank that raised: its traceback, one line naming it, and the launcher's summary
    for name, step, phase in ((0, 2, "compute"), (2, 5, "collective"), (1, 9, "commit")):
        # the library's line and the launcher's name the process alike: its rank now and its name
        line = re.search(rf"allreduce: (rank \d of \d \(name {name}\)) failed with RuntimeError: check_rank and exit: "
                         rf"name {name} at step {step} in {phase}; it leaves the elastic job", result.stderr)
        assert line, text[-4000:]
        assert f"{line.group(1)} failed with RuntimeError" in _summary(result.stderr), _summary(result.stderr)
        assert _failed(name, step, phase) in _summary(result.stderr)
    assert result.stderr.count("Traceback (most recent call last)") == 3
    assert "second line" not in _summary(result.stderr)        # the first line of the message only
    assert _summary(result.stderr).startswith("allreduce-run: elastic job finished with 1 of 4 ranks; ")
    assert sorted(re.findall(r"\(name (\d+)\)(?=[^;]* died at)", _summary(result.stderr))) == ["0", "1", "2"]


def test_every_rank_raising_ends_the_job_non_zero():
    start = time.monotonic()
    result = launch_job(3, "", env={"ELASTIC_RAISES": "0@4:compute,1@4:compute,2@4:compute", "ELASTIC_STEPS": "6"})
    text = result.stdout + result.stderr
    assert result.returncode == 1, f"launcher exited {result.returncode}\n{text[-5000:]}"
    summary = _summary(result.stderr)
    assert summary.startswith("allreduce-run: elastic job failed: no rank finished, 3 raised; "), summary
    for name in range(3):                      # each raises at step 4 (a rank that recovered first too)
        assert _failed(name, 4, "compute") in summary, summary
    assert "FINAL" not in result.stdout
    assert time.monotonic() - start < 60, "the job did not end at once"


def test_the_reset_limit_ends_the_job_at_the_reset_past_it():
    result = launch_job(4, "", "--reset-limit", "1", env={"ELASTIC_RAISES": "1@2:compute,2@5:compute",
                                                          "ELASTIC_STEPS": "8"})
    text = result.stdout + result.stderr
    assert result.returncode == launch.RESET_LIMIT_EXIT, f"launcher exited {result.returncode}\n{text[-5000:]}"
    said = re.findall(r"allreduce-elastic: reset limit 1 reached: the world was reset 1 time\(s\) and the death "
                      r"would reset it again .*; the last commit was commit \d+ \(step=\d+, commits=\d+, "
                      r"in_run=r0, rendezvous=\d+\); stopping", result.stderr)
    assert len(said) == 2, text[-4000:]                          # both survivors, 0 and 3
    summary = _summary(result.stderr)
    assert summary.startswith("allreduce-run: elastic job stopped: reset limit 1 reached: "), summary
    assert _failed(1, 2, "compute") in summary and _failed(2, 5, "compute") in summary
    assert "going on with 3 of 4 ranks" in result.stderr and "going on with 2 of 4" not in result.stderr
    assert "FINAL" not in result.stdout


# --------------------------------------------------------------------------- without MPI
def test_launcher_reset_limit_flag_and_summary_lines():
    rest, options = launch.split_flags(["--elastic", "--reset-limit", "0", "-x", "A"])
    assert rest == ["-x", "A"] and options.reset_limit == 0
    assert launch.split_flags(["--elastic"])[1].reset_limit == -1
    with pytest.raises(SystemExit, match="--reset-limit needs a non-negative integer"):
        launch.split_flags(["--elastic", "--reset-limit", "x"])
    with pytest.raises(SystemExit, match="add --elastic"):
        launch.split_flags(["--reset-limit", "2"])
    env = launch.environment(options, {})
    assert env["ALLREDUCE_ELASTIC_RESET_LIMIT"] == "0" and env["PRTE_MCA_state_base_error_non_zero_exit"] == "0"
    unset = launch.split_flags(["--elastic"])[1]               # the user's variable stays when no flag is given
    assert "ALLREDUCE_ELASTIC_RESET_LIMIT" not in launch.environment(unset, {"ALLREDUCE_ELASTIC_RESET_LIMIT": "3"})
    summary = launch.Summary(3)
    summary.feed("allreduce-elastic: rank 1 of 3 (name 2) raised ValueError: bad record 17; it leaves the job")
    summary.feed("allreduce-elastic: rank 1 of 3 (name 2) died (noticed at 10:00:00.000 UTC); going on with 2 of 3 ranks")
    summary.feed("allreduce-elastic: run(train) finished with 2 ranks (started with 3)")
    assert summary.report(0) == ("allreduce-run: elastic job finished with 2 of 3 ranks; rank 1 of 3 (name 2) failed with "
                                 "ValueError: bad record 17; rank 1 of 3 (name 2) died at 10:00:00.000 UTC", 0)
    below = launch.Summary(3)                                   # below --min-np: the death is named, once
    for _ in range(2):
        below.feed("allreduce-elastic: below --min-np 3: rank 1 of 3 (name 1) died and 2 rank(s) are left; the last commit "
                   "was commit 2 (step=10); stopping")
    assert below.report(0) == ("allreduce-run: elastic job stopped below --min-np: rank 1 of 3 (name 1) died",
                               launch.BELOW_MIN_EXIT)
    limit = launch.Summary(3)
    limit.feed("allreduce-elastic: reset limit 0 reached: the world was reset 0 time(s) and ...; stopping")
    assert limit.report(0) == ("allreduce-run: elastic job stopped: reset limit 0 reached: the world was reset "
                               "0 time(s) and ...; stopping; no rank died", launch.RESET_LIMIT_EXIT)


NAMES = ("commits", "in_run", "epoch", "batch", "rendezvous", "variables", "model", "optimizer", "saved_state",
         "reset_callbacks", "host_messages", "name", "rank", "size", "step")


def test_every_keyword_round_trips_through_commit_restore_and_sync(monkeypatch):
    values = {name: i for i, name in enumerate(NAMES)}
    values["w"] = np.arange(3.0)
    state = ObjectState(**values)
    assert {n: getattr(state, n) for n in NAMES} == {n: values[n] for n in NAMES}
    public = {n for n in vars(state) if not n.startswith("_")}
    assert public == set(values), f"the library's own public attributes: {public - set(values)}"
    for name in NAMES:
        setattr(state, name, getattr(state, name) + 100)
    state.w += 1
    state.commit()                                             # the library counts nothing the user sees
    assert all(getattr(state, n) == values[n] + 100 for n in NAMES) and state.w.tolist() == [1, 2, 3]
    for name in NAMES:
        setattr(state, name, -1)
    state.w[:] = 0                                             # in place: the commit must not share it
    state.restore()
    assert all(getattr(state, n) == values[n] + 100 for n in NAMES) and state.w.tolist() == [1, 2, 3]
    sent = []
    monkeypatch.setattr(state_module, "_broadcast_object",     # rank 0's side of the broadcast, pickled
                        lambda obj: sent.append(obj) or pickle.loads(pickle.dumps(obj)))
    state.sync()
    assert all(getattr(state, n) == values[n] + 100 for n in NAMES) and state.w.tolist() == [1, 2, 3]
    assert set(sent[0][0]) == set(values)                      # what goes out: the user's keywords only
    assert state.describe().startswith("commit 1 (commits=100, in_run=101, ")


@pytest.mark.parametrize("name", ["commit", "sync", "restore", "save", "describe", "_commits", "_saved_state"])
def test_a_keyword_that_would_hide_the_state_s_own_is_refused(name):
    with pytest.raises(ValueError, match=f"'{name}' is taken by the state itself"):
        ObjectState(**{name: 1})
