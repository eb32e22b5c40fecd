"""How a :class:`~allreduce.comm.Communicator` runs ``algorithm="auto"``: the same pick on every rank.

Three sources, in order, for a message of n bytes:

1. a kept pick (``auto_picks``): what the run-time tuner kept for n, or rank
   0's model pick, broadcast once;
2. the tuner (:mod:`allreduce.autotune`), on MPI: the first calls of n time
   the model's best few, the ranks agree on the scores, the fastest is kept,
   and a kept pick of 1 MiB and up stays watched;
3. the cost model (:mod:`allreduce.algorithms.select`): ``choose`` on this
   rank, ``pick`` agreed with rank 0 where ranks could read different fits.

An in-place call on a registered array (``shared_empty``) of 64 KiB or more
is booked apart from a private array of its size (:meth:`AutoChooser.auto_key`):
shm reduces it where it lies, at 2 bytes moved per byte instead of 4.5, so it
is a different contest (-np 2, 4 MiB, by hand: shm 426 us in place against
rhd's 1042 us on the private array, where shm's copy-in took 1078).

Every decision is taken at the same call on every rank (the ranks make the
same calls in the same order), so no two ranks ever run different algorithms.
This module is the communicator's mixin for all of it; ``comm.py`` keeps the
validation and the collectives.
"""
from __future__ import annotations

import logging

import numpy as np

from . import algorithms, autotune
from .algorithms import network, select
from .algorithms.broadcast import broadcast as _broadcast
from .config import ALGORITHM_NAMES
from .ops import Op
from .transport import shared

__all__ = ["AutoChooser", "REGISTERED_MIN_BYTES", "SMALL_BYTES", "NET_MARGIN"]

log = logging.getLogger("allreduce.auto")

_ALGO_CODES = {name: i for i, name in enumerate(ALGORITHM_NAMES)}


#: Smaller calls on registered arrays are keyed as private ones: there the in-place path's two
#: all-to-all flag rounds cost more than the bytes it saves (2-core VM, report sweeps: -np 2 it
#: tied the best at 64 KiB, 23.6 against 18.4-22 us, and won from 256 KiB; -np 4 from 1 MiB), and
#: the check (shared.find, ~0.2 us) would weigh on calls of a few microseconds.
REGISTERED_MIN_BYTES = 64 << 10
#: Across nodes a measured winner replaces the network model's pick only when this much faster.
NET_MARGIN = 1.10
#: Below this a kept pick is all a call needs: not watched (autotune.WATCH_BYTES), not registered.
SMALL_BYTES = min(REGISTERED_MIN_BYTES, autotune.WATCH_BYTES)


def _size(key: int) -> int:
    """The message size behind an :meth:`AutoChooser.auto_key` (``~size`` for a registered array)."""
    return key if key >= 0 else ~key


class AutoChooser:
    """``auto``'s choosing, mixed into :class:`~allreduce.comm.Communicator` (which sets ``transport``,
    ``config``, ``workspace``, ``tuner``, ``auto_picks``, ``cold`` and the caches used here)."""

    @property
    def auto_candidates(self) -> tuple[str, ...]:
        """What ``algorithm="auto"`` chooses among on this transport and node layout."""
        if self._candidates is None:
            self._candidates = self._list_candidates()
        return self._candidates

    def _list_candidates(self) -> tuple[str, ...]:
        names = ["ring", "tree", "rhd", "rd"]
        if self._mpi_transport:
            names.append("mpi")                      # the MPI library's own: unbeatable latency
            if self.local_size == self.size and self.size > 1:
                names.append("shm")                  # one node: reduce straight from shared memory
            elif self.nodes < self.size and self._link is not None:
                names.append("hierarchical")         # real nodes of several ranks: shm inside, ring across
        return tuple(names)

    @property
    def nodes(self) -> int:
        """Hosts this job spans by MPI's real placement (``ar.init()`` sets ``transport.nodes``;
        ``ALLREDUCE_FAKE_NODE_SIZE`` does not count): above 1, ``auto`` prices the network."""
        return getattr(self.transport, "nodes", 1)

    @property
    def _link(self):
        """The inter-node :class:`~allreduce.algorithms.network.Link` when the job spans nodes, else None."""
        return getattr(self.transport, "link", None) if self.nodes > 1 else None

    def auto_resolve(self, flat: np.ndarray, src: np.ndarray | None, transport) -> tuple:
        """What an ``auto`` call on ``flat`` runs: ``(algorithm, trial, watch)``, the trial and
        watch being the tuner's books to feed with this call's time (None: nothing to time).
        ``transport``: a sub-transport the caller runs on (no tuning there), or None."""
        key = self.auto_key(flat, src)
        trial = watch = None
        algorithm = self.auto_picks.get(key)
        if algorithm is None:
            if self.tuner is not None and transport is None and flat.size:
                trial = self.tuner.trials.get(key) or self._start_trial(key)
            algorithm = self.pick(key) if trial is None else trial.current()
        elif self.tuner is not None and transport is None:
            watch = self.tuner.watches.get(key)
        return algorithm, trial, watch

    def auto_settled(self, flat: np.ndarray, src: np.ndarray | None, transport) -> bool:
        """Will :meth:`auto_resolve` answer without a message? (a kept pick, or a trial under way:
        then the call's metadata check may ride in the chosen algorithm's own messages, and the
        tuner times each contender with its check)."""
        key = self.auto_key(flat, src)
        return key in self.auto_picks or (self.tuner is not None and transport is None
                                          and key in self.tuner.trials)

    def auto_key(self, flat: np.ndarray, src: np.ndarray | None = None) -> int:
        """How auto's books (kept picks, the tuner's trials and watches) know a call: its size in
        bytes, or ``~size`` (a negative number) for an in-place call on a registered array
        (``shared_empty``) of ``REGISTERED_MIN_BYTES`` or more, which shm reduces where it lies:
        another contest than a private array of the same size, so it is tuned apart."""
        if src is None and flat.nbytes >= REGISTERED_MIN_BYTES and shared.find(self.transport, flat) is not None:
            return ~flat.nbytes
        return flat.nbytes

    def pick(self, nbytes: int) -> str:
        """What ``algorithm="auto"`` runs for ``nbytes``: the same on every rank.

        The first call of a size keeps the tuner's winner once it has one (``_decide``); any
        other first call takes rank 0's :meth:`choose`, broadcast (8 bytes, once per size) where
        ranks could disagree: on MPI with more than one rank, where every node may read its own
        fitted cost-model file. Every rank makes the same calls in the same order (the metadata
        check holds them to it), so every rank broadcasts at the same call.
        """
        name = self.auto_picks.get(nbytes)
        if name is None:
            name = self.choose(_size(nbytes))
            if self._agree:
                code = np.array([_ALGO_CODES[name]], np.int64)
                _broadcast(self.transport, code, 0)
                name = ALGORITHM_NAMES[int(code[0])]
            self._keep(nbytes, name)
        return name

    def _start_trial(self, nbytes: int):
        """The first ``auto`` call of ``nbytes`` with the tuner on: rank 0's ranking says what to
        try and how often (one tiny broadcast), so every rank runs the same algorithms even where
        each node reads its own fitted file. Returns the trial; or None (the tuner already times
        its most sizes at once, the same on every rank; or rank 0's model has one contender,
        which is then kept), and :meth:`pick` decides."""
        if self.tuner.busy():
            return None
        k = autotune.CONTENDERS
        plan = np.full(1 + 2 * k, -1, np.int64)            # trials, k codes, k predictions (ns)
        if self.rank == 0:
            ranked = self.ranked(_size(nbytes))
            names = autotune.contenders(ranked)
            plan[0] = autotune.trials_for(ranked[0][1])
            plan[1:1 + len(names)] = [_ALGO_CODES[name] for name in names]
            seconds = dict(ranked)
            plan[1 + k:1 + k + len(names)] = [int(min(t, 1e9) * 1e9) if t > 0 else 0   # 0: unknown (nan too)
                                              for t in (seconds[name] for name in names)]
        _broadcast(self.transport, plan, 0)
        names = [ALGORITHM_NAMES[code] for code in plan[1:1 + k].tolist() if code >= 0]
        if len(names) < 2:
            self._keep(nbytes, names[0])
            return None
        predicted = [ns * 1e-9 for ns in plan[1 + k:1 + k + len(names)].tolist()]
        return self.tuner.start(nbytes, names, int(plan[0]), predicted)

    def _keep(self, nbytes: int, name: str) -> str:
        if len(self.auto_picks) >= 4096:         # every rank clears at the same call
            self.auto_picks.clear()
        self.auto_picks[nbytes] = name
        return name

    def _agree_max(self, values: list[float]) -> list[float]:
        """Every rank's maximum of each of ``values`` (one tiny allreduce on this transport)."""
        out = np.array(values, np.float64)
        algorithms.run("rd", self.transport, out, Op.MAX, workspace=self.workspace, segment_bytes=0)
        return out.tolist()

    def _decide(self, trial) -> None:
        """Every rank has made the last call of the trial's rounds: agree on each contender's
        slowest rank's score. After the first rounds the fastest runs until the recheck
        (:meth:`Trial.recheck`); after the second it is kept for this size."""
        name = self.tuner.finish_round(trial, self._agree_max,
                                       watch=_size(trial.nbytes) >= autotune.WATCH_BYTES)
        if name is not None and self._link is not None:
            name = self._model_unless_beaten(trial, name)
        if name is not None:
            self._keep(trial.nbytes, name)

    def _model_unless_beaten(self, trial, name: str) -> str:
        """Across nodes the model's pick (the trial's first contender) stands unless the winner's
        agreed score beat it by ``NET_MARGIN``: there the model counts bytes through the link, while
        timings of one algorithm on a shared machine swing by 25% from block to block (2 hosts x 2
        ranks on 2 cores, 16 MiB at 1 Gbit/s: the tuner scored mpi 172.9 and hierarchical 180.7 ms and
        kept mpi, which then ran 202 ms against hierarchical's 168 in cluster_bench's blocks)."""
        scores = self.tuner.decided.get(trial.nbytes, {})
        first = trial.contenders[0]
        if first in scores and scores[first] <= NET_MARGIN * scores.get(name, 0.0):
            return first
        return name

    def _check_watch(self, watch) -> None:
        """A window of a kept pick's calls is in, on every rank at the same call: tune the size
        again if the slowest rank's mean is :data:`~allreduce.autotune.REOPEN` times off the
        score it won with, either way."""
        why = self.tuner.check(watch, self._agree_max)
        if why is not None:
            log.info("rank %d: auto's pick %s for %d bytes%s %s; tuning again", self.rank, watch.name,
                     _size(watch.nbytes), " (registered)" if watch.nbytes < 0 else "", why)
            self.auto_picks.pop(watch.nbytes, None)

    def ranked(self, nbytes: int) -> list[tuple[str, float]]:
        """``auto``'s candidates with the model's predicted seconds for ``nbytes``, fastest first
        (across nodes: :mod:`~allreduce.algorithms.network`'s model with the link's constants)."""
        if self._link is not None:
            return network.ranked(nbytes, self.size, self.nodes, self._link, candidates=self.auto_candidates,
                                  path=self.config.costmodel)
        return select.ranked(nbytes, self.size, candidates=self.auto_candidates, path=self.config.costmodel,
                             cold=self.cold)

    def choose(self, nbytes: int) -> str:
        """The cost model's pick for ``nbytes`` on this rank (``auto`` runs :meth:`pick`, the same
        on every rank); remembered for this communicator's life (the cost model is read once, like
        the environment: a small call cannot afford more)."""
        name = self._auto.get(nbytes)
        if name is None:
            name = self.ranked(nbytes)[0][0] if self._link is not None else select.choose(
                nbytes, self.size, candidates=self.auto_candidates, path=self.config.costmodel, cold=self.cold)
            if len(self._auto) >= 4096:
                self._auto.clear()
            self._auto[nbytes] = name
        return name
