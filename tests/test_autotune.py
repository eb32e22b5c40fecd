"""The run-time tuner of algorithm="auto" (allreduce/autotune.py): its books here, its calls under mpirun."""
import pytest

from allreduce import autotune
from allreduce.autotune import AutoTuner, Trial, contenders, trials_for
from allreduce.config import Config

from .harness import mpirun


def test_contenders_are_the_models_best_and_those_within_the_factor_at_most_four():
    ranked = [("mpi", 1.0), ("rd", 1.5), ("shm", 2.0), ("rhd", 3.0), ("tree", 3.01), ("ring", 9.0)]
    assert contenders(ranked) == ["mpi", "rd", "shm", "rhd"]
    assert contenders([("mpi", 1.0), ("ring", 3.5)]) == ["mpi"]
    assert contenders([("a", 1.0), ("b", 1.1), ("c", 1.2), ("d", 1.3), ("e", 1.4)]) == ["a", "b", "c", "d"]
    assert contenders([]) == []


def test_trials_cover_about_ten_milliseconds_within_bounds():
    assert trials_for(5e-6) == autotune.MAX_TRIALS          # microsecond calls: many samples
    assert trials_for(5e-4) == 20
    assert trials_for(0.002) == autotune.MIN_TRIALS         # milliseconds: six each
    assert trials_for(0.0) == autotune.MAX_TRIALS


def test_a_trial_runs_each_contender_in_blocks_after_an_untimed_call_and_the_best_block_decides():
    assert autotune.ROUNDS == 3
    trial = Trial(64, ["mpi", "rd"], trials=6)
    runs = []
    times = {"mpi": iter([0.9, 0.002, 0.004, 0.8, 0.003, 0.003, 0.7, 0.009, 0.009]),   # warm-up first
             "rd": iter([0.7, 0.0019, 0.0023, 0.6, 0.5, 0.5, 0.4, 0.008, 0.008])}     # ... and a spell
    done = False
    while not done:
        name = trial.current()
        runs.append(name)
        done = trial.record(next(times[name]))
    assert runs == (["mpi"] * 3 + ["rd"] * 3) * 3
    assert trial.times == [[[0.002, 0.004], [0.003, 0.003], [0.009, 0.009]],
                           [[0.0019, 0.0023], [0.5, 0.5], [0.008, 0.008]]]
    assert trial.scores() == [0.003, 0.0021]                 # each one's best block's mean
    assert trial.winner(trial.scores()) == "rd"
    assert trial.winner([1.0, 1.0]) == "mpi"                 # a tie goes to the model's order
    odd = Trial(8, ["a", "b", "c"], trials=7)                 # 7 timed calls: three blocks of 3
    assert [[len(block) for block in blocks] for blocks in _run_out(odd)] == [[3, 3, 3]] * 3


def test_a_size_is_timed_again_after_the_provisional_winner_ran_for_the_gap():
    trial = Trial(64, ["mpi", "rd"], trials=3)                # blocks of one timed call
    first = {"mpi": iter([1.0, 0.004] * 3), "rd": iter([1.0, 0.002] * 3)}   # a spell slows mpi at first
    while not trial.record(next(first[trial.current()])):
        pass
    assert trial.scores() == [0.004, 0.002]
    assert trial.recheck(trial.scores())                      # rd, provisionally, for GAP_SECONDS
    assert trial.gap == autotune.GAP_SECONDS / 0.002 == 250
    runs = []
    while trial.gap:
        runs.append(trial.current())
        assert not trial.record(99.0)                         # the gap's calls are not timed
    assert runs == ["rd"] * 250
    second = {"mpi": iter([1.0, 0.001] * 3), "rd": iter([1.0, 0.002] * 3)}  # the spell is over
    runs = []
    done = False
    while not done:
        runs.append(trial.current())
        done = trial.record(next(second[runs[-1]]))
    assert runs == (["mpi"] * 2 + ["rd"] * 2) * 3
    assert trial.scores() == [0.001, 0.002]                   # the best block of both timings
    assert not trial.recheck(trial.scores()) and trial.winner(trial.scores()) == "mpi"
    quick = Trial(8, ["a", "b"], trials=1)
    _run_out(quick)
    quick.recheck([0.0, 1e-9])                                # agreed scores bound the gap's calls
    assert quick.gap == autotune.MAX_GAP
    slow = Trial(8, ["a", "b"], trials=1)
    _run_out(slow)
    slow.recheck([5.0, 9.0])
    assert slow.gap == autotune.MIN_GAP


def _run_out(trial):
    while not trial.record(1.0):
        pass
    return trial.times


def test_the_tuner_books_sizes_and_stops_taking_new_ones_when_busy():
    tuner = AutoTuner(max_sizes=2)
    a = tuner.start(8, ["mpi", "rd"], 3)
    tuner.start(16, ["mpi", "rd"], 3)
    assert tuner.busy() and tuner.trials[8] is a
    assert tuner.decide(a, [2.0, 1.0]) == "rd"
    assert tuner.decided[8] == {"mpi": 2.0, "rd": 1.0} and 8 not in tuner.trials and not tuner.busy()


def test_autotune_setting_from_the_environment():
    assert Config.from_env({}).autotune is True
    assert Config.from_env({"ALLREDUCE_AUTOTUNE": "0"}).autotune is False


def test_the_in_process_transport_keeps_the_models_choice():
    from allreduce.comm import Communicator
    from allreduce.transport.threads import ThreadWorld
    world = ThreadWorld(2, timeout=10)
    assert Communicator(world.transport(0)).tuner is None


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [3])     # 3, not also 2: the agreement is the same code at any size (15-minute suite)
def test_tuning_under_mpi_agrees_on_every_rank_and_every_result_is_right(np_):
    out = mpirun(np_, "autotune_check.py", timeout=240).stdout
    assert f"OK autotune_check on {np_} ranks" in out, out[-2000:]


@pytest.mark.mpi
def test_autotune_off_keeps_the_models_pick():
    out = mpirun(2, "autotune_check.py", "--off", timeout=120, env={"ALLREDUCE_AUTOTUNE": "0"}).stdout
    assert "OK autotune_check on 2 ranks (off)" in out, out[-2000:]


def test_a_kept_large_pick_is_watched_and_reopened_once_its_time_moves_twofold():
    tuner = AutoTuner()
    small, large = tuner.start(1024, ["mpi", "rd"], 3), tuner.start(autotune.WATCH_BYTES, ["shm", "rhd"], 3)
    tuner.decide(small, [2e-6, 1e-6])
    assert tuner.decide(large, [1e-3, 2e-3]) == "shm"
    assert 1024 not in tuner.watches                     # too small to time every call for free
    watch = tuner.watches[autotune.WATCH_BYTES]
    assert (watch.name, watch.score) == ("shm", 1e-3)
    assert watch.every == round(autotune.WATCH_SECONDS / 1e-3)    # about a second of its calls
    assert not any(watch.record(1e-3) for _ in range(watch.every - 1)) and watch.record(1e-3)
    assert watch.mean() == pytest.approx(1e-3) and watch.calls == 0     # the next window starts
    assert not watch.stale(1.9e-3) and watch.stale(2.1e-3)          # slower: the machine turned
    assert not watch.stale(0.6e-3) and watch.stale(0.4e-3)          # faster: the trial ran in a slow spell
    for k in range(1, autotune.MAX_REOPENS + 1):
        tuner.reopen(autotune.WATCH_BYTES)
        assert autotune.WATCH_BYTES not in tuner.watches and autotune.WATCH_BYTES not in tuner.decided
        assert tuner.reopened == k
        again = tuner.start(autotune.WATCH_BYTES, ["shm", "rhd"], 3)
        tuner.decide(again, [1e-3, 2e-3])
    # reopens spent: a window twice as slow no longer reopens it (its explorations still come)
    watch = tuner.watches[autotune.WATCH_BYTES]
    assert tuner.check(watch, lambda v: [5e-3]) is None and autotune.WATCH_BYTES in tuner.decided


def test_a_watched_pick_is_explored_after_doubling_windows_a_few_times_then_kept():
    tuner, n = AutoTuner(), autotune.WATCH_BYTES
    same = lambda values: values                          # one rank: the agreed mean is its own
    windows = []
    for k in range(autotune.MAX_EXPLORES):
        tuner.decide(tuner.start(n, ["shm", "rhd"], 3), [1e-3, 2e-3])
        watch, checks = tuner.watches[n], 0
        assert watch.explore_after == autotune.EXPLORE_WINDOWS * 2 ** k
        why = None
        while why is None:
            for _ in range(watch.every):
                watch.record(1e-3)                          # its time holds: never stale
            why, checks = tuner.check(watch, same), checks + 1
        windows.append(checks)
        assert why.startswith(f"kept for {checks} windows") and n not in tuner.decided
        assert tuner.explores[n] == k + 1 and tuner.reopens.get(n, 0) == 0
    assert windows == [4, 8, 16, 32]
    tuner.decide(tuner.start(n, ["shm", "rhd"], 3), [1e-3, 2e-3])
    assert tuner.watches[n].explore_after == 0            # explorations spent: drift alone reopens it
    watch = tuner.watches[n]
    assert tuner.check(watch, lambda v: [3e-3]).startswith("moved from 0.001 to 0.003")


def test_a_timing_in_a_slow_spell_is_repeated_with_a_doubling_gap():
    """Every contender at 3x its predicted time or more: the timing ranked nothing, time it again;
    the scores are the best block of every timing, so the first fast timing decides."""
    trial = Trial(1 << 20, ["shm", "mpi"], trials=3, predicted=[70e-6, 110e-6])
    spell = [750e-6, 720e-6]
    assert trial.in_spell(spell) and not trial.in_spell([200e-6, 720e-6])
    gaps = []
    for timing in range(1 + autotune.MAX_RECHECKS):
        while not trial.record(750e-6 if trial.current() == "shm" else 720e-6):
            pass
        slowest = trial.scores()
        assert slowest == pytest.approx(spell)
        if not trial.recheck(slowest):
            break
        gaps.append(trial.gap)
        while trial.gap:
            trial.record(1.0)
    assert gaps == [round(autotune.GAP_SECONDS * 2 ** k / 720e-6 + 0.5) for k in range(autotune.MAX_RECHECKS)]
    assert trial.rechecks == autotune.MAX_RECHECKS          # at most this many: then it decides anyway
    calm = Trial(1 << 20, ["shm", "mpi"], trials=3, predicted=[70e-6, 110e-6])
    _run_out(calm)
    assert calm.recheck([750e-6, 720e-6])                    # the first recheck comes anyway
    assert not calm.recheck([71e-6, 112e-6])                 # out of the spell: decided
    blind = Trial(1 << 20, ["shm", "mpi"], trials=3)         # no model: one recheck, as before
    _run_out(blind)
    assert blind.recheck([750e-6, 720e-6]) and not blind.recheck([750e-6, 720e-6])


@pytest.mark.mpi
def test_a_pick_that_slows_down_under_mpi_is_tuned_again():
    out = mpirun(2, "autotune_watch.py", timeout=240).stdout
    assert "OK autotune_watch on 2 ranks" in out, out[-2000:]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [3])     # (2 dropped for the 15-minute suite, as above)
def test_a_registered_array_is_tuned_apart_from_a_private_one_of_the_same_size(np_):
    """auto's books key an in-place call on a shared_empty array by ~size: it is timed against the
    others where it runs, shm reduces it in place when shm wins, and a private array of the same
    size keeps its own pick (tests/mpi/autotune_registered.py)."""
    out = mpirun(np_, "autotune_registered.py", timeout=240).stdout
    assert f"OK autotune_registered on {np_} ranks" in out, out[-2000:]
