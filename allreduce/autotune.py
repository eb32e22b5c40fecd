"""Run-time tuning of ``algorithm="auto"``: time the model's best few on the first calls, keep the fastest.

The cost model (:mod:`allreduce.algorithms.select`) ranks the algorithms
from constants fitted in one benchmark run. On a shared machine that run
can be minutes or days away from this one, and near-ties flip: on the
2-core VM the fastest algorithm at 64 MiB was rhd in one report run and shm
(1.5x faster) in the next. A training loop calls allreduce on the same
sizes thousands of times, so it can afford to measure, as Horovod's
``HOROVOD_AUTOTUNE`` and Intel MPI's autotuner do::

    calls of one size:  1 2 3 4 | 5 6 7 8 | 9 ...   | ... 2Cb | the provisional winner for
                                                                  ~GAP_SECONDS, then the rounds
                                                                  again; then the winner, for good
    what runs:          c1 ...  | c2 ...  | c3 ...  | round 2: c1, c2, c3 again
                        ^ each block: one untimed call (the switch from another
                          algorithm: its cache, its first pages), then b timed ones
       |                                                        |
       rank 0's ranking is broadcast: every rank tries the      one tiny MAX allreduce of
       same algorithms in the same order (several nodes         every rank's score per
       may each have their own fitted file)                     contender -> every rank
                                                                picks the same argmin

* Each contender runs in blocks of back-to-back calls, as a loop of one size
  calls it, in ``ROUNDS`` rounds (c1 c2 c3, then c1 c2 c3 again, ...), so a
  slow moment of a shared machine does not fall on one contender alone. A
  block's first call is not counted: it pays for the switch (the other
  algorithm's data in the cache, first-touch pages of a new workspace, a
  kernel loaded). Timing contenders one call each in turn did not work: on
  the 2-core VM every call then found the cache full of the other
  algorithm's buffers, and at 1 MiB the tuner kept mpi or rd (medians 210
  and 174 us) over shm, which runs 103 us back to back.
* A contender's score is its best block's mean: on a shared machine noise
  only adds time, and it comes in spells that last several calls (a 64 MiB
  shm call took 11.7 ms, then 25.9, 23.8 and 24.9 ms, by hand), so the
  median of all calls picked whichever contender a spell missed (ring over
  shm at 64 MiB, -np 2: 15.3 against 10.8 ms back to back). The benchmark
  (``allreduce_bench.py --repeats``) and Python's ``timeit`` take the best
  block for the same reason.
* Every size is timed twice, ``GAP_SECONDS`` apart: the first rounds pick a
  provisional winner (agreed like the final one), which runs alone until
  the rounds come again; then every contender's score is its best block of
  both. A spell longer than one trial can no longer decide a size for good:
  at -np 4 on the 2-core VM the first size of a sweep, tuned in the first
  tenth of a second, once scored mpi 177 and rd 99 us, and auto ran rd at
  23 us per call for the whole sweep where mpi ran 11. The gap is counted
  in calls (the same on every rank: it comes from the agreed scores).
* A spell can outlast the gap: a recorded -np 2 sweep timed all four
  contenders at 1 MiB at 719-779 us, twice, where shm then ran at 71 and
  mpi at 112. So the model's predicted time for each contender travels with
  rank 0's plan, and while every agreed score is ``SPELL`` times its
  prediction or more (the timing ranked nothing), the size is timed again,
  the gap doubling, up to ``MAX_RECHECKS`` times. A wrong model only costs
  those extra timings (seconds per size, the provisional winner running
  meanwhile).
* k = :func:`trials_for` the model's predicted time: timed calls per
  contender, 6 for calls of 2 ms and more, up to 96 for microsecond ones,
  so each contender is timed over about ``TRIAL_SECONDS``: on the 2-core VM
  one 4 MiB call of native MPI took anything from 443 to 1069 us within a
  few calls (by hand), so two or three calls cannot rank contenders 10%
  apart. It costs nothing but time spent on a slower contender, once per size.
* Contenders are the model's best and those predicted within ``WITHIN`` of
  it, at most ``CONTENDERS``: an algorithm the model ranks 10x slower is
  never tried. With one contender there is nothing to try: it is kept.
* Every rank makes the same calls in the same order (MPI requires it), so
  every rank runs the same contender on the same call, and both agreements
  happen on the same call everywhere.
* A trial is a real allreduce: its result is correct and bitwise identical on
  all ranks. Two calls of one size may differ in the last bits while tuning
  (different algorithms add in different orders), never between ranks.

* A kept pick is watched (sizes of ``WATCH_BYTES`` and up, where timing a
  call costs nothing next to it): every ``WATCH_SECONDS`` of its calls the
  ranks agree on their mean (one tiny MAX allreduce, at the same call
  everywhere), and if the slowest rank's mean has moved by ``REOPEN`` times
  from the score it won with, either way, the size is tuned again from
  scratch, at most ``MAX_REOPENS`` times. On the 2-core VM a launch can turn
  slow for ``shm`` after it won (a recorded -np 2 sweep kept shm at 64 MiB,
  where it then ran 3x slower than rhd), and a trial can fall into a slow
  spell that makes every contender look alike (another kept mpi at 1 MiB,
  all four scored 591-623 us, where shm then ran at 66 us and mpi at 117).
* A kept pick says nothing about the others: a contender that lost in a
  slow moment of its own (shm at 16 MiB scored 7.7 ms in one trial, rhd
  2.8, and shm then ran its row at 2.0) is never timed again while the
  pick holds its time. So every watched size is tuned again anyway after
  ``EXPLORE_WINDOWS`` windows, then after twice as many, ``MAX_EXPLORES``
  times (about a minute of calls of that size in all); a trial costs a few
  tens of milliseconds of slower contenders, so the share of calls lost to
  it is at most about 2% of the calls' time at the first, halving each time, then nothing.

The blocking path (:meth:`Communicator.allreduce_`, ``ar.allreduce``) tunes
per size, and the engine tunes each direct batch with the same :class:`Trial`
(shm's many-call against rhd per array: :mod:`allreduce.engine.reducer`);
both only on the MPI transport. The in-process transport (tests,
``allreduce-explain``) keeps the model's deterministic choice.
``ALLREDUCE_AUTOTUNE=0`` turns both off.

This module only keeps the books; the communicator runs the calls and the
two agreements.
"""
from __future__ import annotations

import math

__all__ = ["AutoTuner", "Trial", "Watch", "contenders", "trials_for", "CONTENDERS", "WITHIN", "TRIAL_SECONDS",
           "ROUNDS", "GAP_SECONDS", "SPELL", "MAX_RECHECKS", "WATCH_BYTES", "WATCH_SECONDS", "REOPEN", "MAX_REOPENS",
           "EXPLORE_WINDOWS", "MAX_EXPLORES"]

CONTENDERS = 4           #: at most this many algorithms are timed per size
WITHIN = 3.0             #: only algorithms predicted at most this many times the model's best
TRIAL_SECONDS = 1e-2     #: about this long per contender: more calls for shorter ones...
MIN_TRIALS, MAX_TRIALS = 6, 96   #: ...within these bounds
ROUNDS = 3               #: each contender's timed calls come in this many blocks, each after one untimed
GAP_SECONDS = 0.5        #: between the two timings of a size, the provisional winner runs about this long
MIN_GAP, MAX_GAP = 16, 100_000   #: ...counted in its calls, within these bounds
SPELL = 3.0              #: a timing where every contender ran this many times the model's prediction...
MAX_RECHECKS = 3         #: ...is followed by another (the gap doubling), up to this many timings after the first
WATCH_BYTES = 1 << 20    #: kept picks of this size and up are watched...
WATCH_SECONDS = 1.0      #: ...their mean agreed about this often (counted in calls, at least MIN_GAP)...
REOPEN = 2.0             #: ...and the size tuned again once that mean is this factor off the winning score,
MAX_REOPENS = 3          #: ...at most this many times per size
EXPLORE_WINDOWS = 4      #: a kept pick is tuned again anyway after this many windows, then twice as many...
MAX_EXPLORES = 4         #: ...at most this many times per size (4 + 8 + 16 + 32 windows: about a minute)


def contenders(ranked: list[tuple[str, float]]) -> list[str]:
    """The names worth timing from the model's ``ranked`` list (fastest first)."""
    if not ranked:
        return []
    best = ranked[0][1]
    return [name for name, seconds in ranked if seconds <= WITHIN * best][:CONTENDERS]


def trials_for(predicted_seconds: float) -> int:
    """Calls per contender for a call the model predicts takes ``predicted_seconds``."""
    if not predicted_seconds > 0:
        return MAX_TRIALS
    return max(MIN_TRIALS, min(MAX_TRIALS, math.ceil(TRIAL_SECONDS / predicted_seconds)))


class Trial:
    """The tuning of one message size: which contender runs on the next call, and the times so far."""

    __slots__ = ("nbytes", "contenders", "trials", "calls", "times", "_plan", "gap", "provisional", "rechecks",
                 "predicted")

    def __init__(self, nbytes: int, contenders: list[str], trials: int, predicted: list[float] | None = None):
        self.nbytes, self.contenders, self.trials = nbytes, contenders, trials
        self.predicted = predicted   # the model's seconds per contender (the same on every rank), or None
        self.calls = 0
        self.times: list[list[list[float]]] = [[] for _ in contenders]   # per contender: its blocks
        self._plan = self._rounds()
        self.gap = 0                 # calls of the provisional winner still to run before the recheck
        self.provisional = 0
        self.rechecks = 0            # timings after the first, so far

    def _rounds(self) -> list[tuple[int, bool]]:
        """The timed calls in order: (contender index, timed?); a block is one untimed call, then timed ones."""
        per_block = -(-self.trials // ROUNDS)
        return [(i, j > 0) for _ in range(ROUNDS) for i in range(len(self.contenders)) for j in range(1 + per_block)]

    def current(self) -> str:
        """The contender the next call of this size runs."""
        if self.gap:
            return self.contenders[self.provisional]
        return self.contenders[self._plan[self.calls][0]]

    def in_spell(self, slowest: list[float]) -> bool:
        """Every contender's agreed score is ``SPELL`` times the model's prediction or more: the
        timings fell in a slow spell of the machine, which ranks nothing (False without a model)."""
        if not self.predicted or len(self.predicted) != len(slowest):
            return False
        return all(p > 0 and t > SPELL * p for t, p in zip(slowest, self.predicted))

    def recheck(self, slowest: list[float]) -> bool:
        """After a timing's agreement (``slowest``: every rank's maximum of the scores): run the
        provisional winner for a gap, then the rounds again, and return True; or return False,
        the trial is over. After the first timing always (gap ``GAP_SECONDS``); after a later
        one only while :meth:`in_spell`, up to ``MAX_RECHECKS``, the gap doubling each time."""
        if self.rechecks >= MAX_RECHECKS or (self.rechecks and not self.in_spell(slowest)):
            return False
        self.rechecks += 1
        self.provisional = min(range(len(slowest)), key=slowest.__getitem__)
        per_call = slowest[self.provisional]
        seconds = GAP_SECONDS * 2 ** (self.rechecks - 1)
        self.gap = MAX_GAP if not per_call > 0 else max(MIN_GAP, min(MAX_GAP, math.ceil(seconds / per_call)))
        self._plan += self._rounds()
        return True

    def record(self, seconds: float) -> bool:
        """Count the call just made (it ran :meth:`current`); True once the trials of a round are in."""
        if self.gap:
            self.gap -= 1
            return False
        index, timed = self._plan[self.calls]
        if not timed:
            self.times[index].append([])          # a block begins (its untimed call)
        else:
            self.times[index][-1].append(seconds)
        self.calls += 1
        return self.calls >= len(self._plan)

    def scores(self) -> list[float]:
        """This rank's score per contender: the mean seconds of its best block (of both timings)."""
        return [min(sum(block) / len(block) for block in blocks) for blocks in self.times]

    def winner(self, slowest: list[float]) -> str:
        """The contender with the smallest time in ``slowest`` (every rank's maximum of the
        scores; ties go to the model's order)."""
        return self.contenders[min(range(len(slowest)), key=slowest.__getitem__)]


class Watch:
    """A kept pick's running time: ``record`` each call; True once a window of ``every`` calls is in."""

    __slots__ = ("nbytes", "name", "score", "every", "calls", "total", "windows", "explore_after")

    def __init__(self, nbytes: int, name: str, score: float, explore_after: int = 0):
        self.nbytes, self.name, self.score = nbytes, name, score
        self.every = MAX_GAP if not score > 0 else max(MIN_GAP, min(MAX_GAP, math.ceil(WATCH_SECONDS / score)))
        self.calls, self.total = 0, 0.0
        self.windows = 0                    # windows checked so far
        self.explore_after = explore_after  # tune again after this many windows anyway (0: never)

    def record(self, seconds: float) -> bool:
        self.calls += 1
        self.total += seconds
        return self.calls >= self.every

    def mean(self) -> float:
        """This window's mean seconds; starts the next window."""
        mean = self.total / max(self.calls, 1)
        self.calls, self.total = 0, 0.0
        return mean

    def stale(self, slowest_mean: float) -> bool:
        """True when the pick's time (every rank's maximum) is ``REOPEN`` times off its winning
        score: slower (the machine turned against it), or faster (the trial ran in a slow spell,
        and its scores no longer rank anything)."""
        return slowest_mean > REOPEN * self.score or slowest_mean * REOPEN < self.score


class AutoTuner:
    """Books of the sizes being tuned (``trials``) and of the decisions made (``decided``)."""

    def __init__(self, max_sizes: int = 256):
        self.max_sizes = max_sizes          # sizes tuned at once; more are not tuned until some finish
        self.trials: dict[int, Trial] = {}
        self.watches: dict[int, Watch] = {}  # nbytes -> the kept pick's running time (large sizes)
        self.reopened = 0                   # sizes tuned again because their pick's time moved
        self.reopens: dict[int, int] = {}   # nbytes -> times tuned again (at most MAX_REOPENS)
        self.explores: dict[int, int] = {}  # nbytes -> times tuned again unasked (at most MAX_EXPLORES)
        self.decided: dict[int, dict[str, float]] = {}   # nbytes -> {contender: agreed score, seconds}

    def busy(self) -> bool:
        """Too many sizes in flight to start another."""
        return len(self.trials) >= self.max_sizes

    def start(self, nbytes: int, names: list[str], trials: int, predicted: list[float] | None = None) -> Trial:
        """Begin timing ``names`` (the agreed contenders, two or more) at ``nbytes``; ``predicted``:
        the model's seconds for each (agreed too), for :meth:`Trial.in_spell`."""
        trial = self.trials[nbytes] = Trial(nbytes, names, trials, predicted)
        return trial

    def decide(self, trial: Trial, slowest: list[float], *, watch: bool | None = None) -> str:
        """Close ``trial`` with the agreed times; return the winner. ``watch``: keep a
        :class:`Watch` on it (default: for sizes of ``WATCH_BYTES`` and up)."""
        del self.trials[trial.nbytes]
        if len(self.decided) >= 4096:
            self.decided.clear()
            self.watches.clear()
        self.decided[trial.nbytes] = dict(zip(trial.contenders, slowest))
        name = trial.winner(slowest)
        if watch is None:
            watch = trial.nbytes >= WATCH_BYTES
        explored = self.explores.get(trial.nbytes, 0)
        explore_after = EXPLORE_WINDOWS * 2 ** explored if explored < MAX_EXPLORES else 0
        if watch and (self.reopens.get(trial.nbytes, 0) < MAX_REOPENS or explore_after):
            self.watches[trial.nbytes] = Watch(trial.nbytes, name, min(slowest), explore_after)
        return name

    def finish_round(self, trial: Trial, agree, *, watch: bool | None = None) -> str | None:
        """Every rank has made the last call of a round of ``trial``: agree on the scores
        (``agree``: a list of floats -> every rank's maximum of each, a collective), then recheck
        (None) or decide (the winner, kept from now on; ``watch`` as for :meth:`decide`)."""
        slowest = agree(trial.scores())
        if trial.recheck(slowest):
            return None
        return self.decide(trial, slowest, watch=watch)

    def check(self, watch: Watch, agree) -> str | None:
        """A window of ``watch``'s calls is in on every rank: agree on its mean (``agree`` as for
        :meth:`finish_round`). Forget the decision (:meth:`reopen`) and say why if the mean is
        stale ("moved from S to M s a call"), or if the watch has seen its ``explore_after``
        windows ("kept for N windows": nothing else is timed while a pick is kept, and a
        contender that lost in a slow moment of its own may be the fastest now); else None."""
        mean = agree([watch.mean()])[0]
        n = watch.nbytes
        if watch.stale(mean) and self.reopens.get(n, 0) < MAX_REOPENS:
            self.reopen(n)
            return f"moved from {watch.score:.3g} to {mean:.3g} s a call"
        watch.windows += 1
        if watch.explore_after and watch.windows >= watch.explore_after:
            self.reopen(n, explore=True)
            return f"kept for {watch.windows} windows of {watch.every} calls"
        return None

    def reopen(self, nbytes: int, explore: bool = False) -> None:
        """Forget the decision for ``nbytes``: its next call starts a new trial. Counted as a
        reopen (its time moved), or with ``explore`` as an exploration."""
        self.watches.pop(nbytes, None)
        self.decided.pop(nbytes, None)
        counts = self.explores if explore else self.reopens
        counts[nbytes] = counts.get(nbytes, 0) + 1
        self.reopened += 1
