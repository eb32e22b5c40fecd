"""``allreduce-run --elastic``: what the launcher adds for an elastic job, and its summary.

::

    allreduce-run --elastic -np 4 --min-np 2 [--max-np 6] [--reset-limit 3] python train.py

becomes ``mpirun -np 4 --with-ft ulfm --mca btl tcp,self ... python train.py``
with ``ALLREDUCE_ELASTIC=1`` (waits notice dead peers, ``allreduce.elastic.run``
may shrink), ``ALLREDUCE_ELASTIC_MIN_NP=2``, ``ALLREDUCE_ELASTIC_RESET_LIMIT``
(Horovod's ``--reset-limit``: how many times the world may shrink or grow; -1,
the default, no limit), ``ALLREDUCE_SHM_P2P=1`` and
``PRTE_MCA_state_base_error_non_zero_exit=0``:

* ``--with-ft ulfm``: Open MPI's fault tolerance. Without it a dead rank makes
  mpirun terminate the job.
* ``--oversubscribe`` (and ``--bind-to none``) when ``--max-np`` is more than the
  cores and no hosts are given: replacements spawned on this host need slots.
* ``--mca btl tcp,self``: Open MPI's shared-memory BTL (``sm``) does not report a
  dead peer; the survivors hung in ``MPI_Comm_shrink`` over it (by hand, Open MPI
  5.0.11). Only MPI's own messages move to TCP: the library's shared-memory paths
  (the ``shm`` algorithm's windows, the mailboxes, turned back on with
  ``ALLREDUCE_SHM_P2P=1``) use MPI-3 shared windows, not the BTL, and notice a dead
  peer themselves (:mod:`allreduce.transport.liveness`).
* ``PRTE_MCA_state_base_error_non_zero_exit=0``: a rank whose training function
  raised leaves the job with exit status 1 (:mod:`.failure`); by default Open MPI's
  runtime then ends every other rank, even under ULFM (by hand, 5.0.11).

``ALLREDUCE_ELASTIC_JOB`` (a key of this launch: the launcher's pid and start
time) names the heartbeat table of the job on each node (:mod:`.heartbeat`); the
launcher removes its own host's at the end, and at its start the tables of
launchers that are gone (killed before their end: :func:`.evict.remove_stale`). An ``evict`` line from a rank makes the launcher SIGKILL that process
at once (:mod:`.evict`, called from ``run.py``'s relay of mpirun's stderr). How long a
rank may go without a heartbeat first: ``ALLREDUCE_ELASTIC_HANG_TIMEOUT`` (default
``ALLREDUCE_TIMEOUT``, 30 s; shorter recovers sooner and evicts more ranks that were only slow).

The ranks write ``allreduce-elastic:`` lines to stderr (:func:`say`; :mod:`.recovery`,
:mod:`.regrow`, :mod:`.watchdog`, :mod:`.failure`); the launcher relays them and ends with one summary
line: which ranks raised (with their exception's first line), which were evicted (why, after how long),
which died, when, which joined, and the
size the job finished at. It exits 0 when the job finished, even though ranks raised or died on the
way, and non-zero when it fell below ``--min-np`` (3), a rank was stuck inside Open MPI past
``elastic_recovery_timeout`` (4, naming the rank and the step), the reset limit was reached (5), or
no rank finished (every rank raised: 1).
"""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field

__all__ = ["ElasticOptions", "split_flags", "mpirun_flags", "environment", "Summary", "say", "finished", "clock", "MARK",
           "BELOW_MIN_EXIT", "STUCK_EXIT", "RESET_LIMIT_EXIT"]

MARK = "allreduce-elastic:"       #: the prefix of the lines the ranks write and the launcher reads
BELOW_MIN_EXIT = 3                #: exit status of every survivor when the job falls below --min-np
RESET_LIMIT_EXIT = 5              #: exit status of every rank when the reset limit ends the job

_RANKS = r"(rank \d+ of \d+ \(name \d+\)(?:, rank \d+ of \d+ \(name \d+\))*)"   # world.describe()
_DIED = re.compile(re.escape(MARK) + " " + _RANKS + r" died \(noticed at ([\d:.]+ UTC)(, unreachable)?[^)]*\); "
                   r"going on with (\d+)")
_JOINED = re.compile(re.escape(MARK) + " " + _RANKS + r" joined \(spawned at ([\d:.]+ UTC)\)")
_NO_SPAWN = re.compile(re.escape(MARK) + r" could not spawn (\d+) replacement")
_FINISHED = re.compile(re.escape(MARK) + r" run\(\S+\) finished with (\d+) ranks")
_BELOW = re.compile(re.escape(MARK) + r" below --min-np(?: \d+: " + _RANKS + " died)?")
_STUCK = re.compile(re.escape(MARK) + r" (.+?) stuck inside Open MPI in (.+?) for (\d+) s")
_RAISED = re.compile(re.escape(MARK) + r" (rank \d+ of \d+ \(name \d+\)) raised (.*); it leaves the job")
_LIMIT = re.compile(re.escape(MARK) + r" (reset limit \d+ reached: .*)$")
_EVICTED = "allreduce-run: evicted "   # the launcher's own line for an eviction (evict.py, run.py)
STUCK_EXIT = 4                    #: exit status of a job the elastic watchdog aborted (watchdog.py)


@dataclass
class ElasticOptions:
    min_np: int = 1
    max_np: int = 0
    reset_limit: int = -1          #: how many times the world may shrink or grow (-1: no limit)


def split_flags(args: list[str]) -> tuple[list[str], ElasticOptions | None]:
    """Take ``--elastic``, ``--min-np M``, ``--max-np K`` and ``--reset-limit N`` out of the mpirun flags."""
    rest, options, elastic = [], ElasticOptions(), False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--elastic":
            elastic, i = True, i + 1
        elif arg in ("--min-np", "--max-np", "--reset-limit"):
            least = 0 if arg == "--reset-limit" else 1
            if i + 1 >= len(args) or not args[i + 1].isdigit() or int(args[i + 1]) < least:
                raise SystemExit(f"allreduce-run: {arg} needs a {'non-negative' if least == 0 else 'positive'} "
                                 "integer")
            setattr(options, arg[2:].replace("-", "_"), int(args[i + 1]))
            i += 2
        else:
            rest.append(arg)
            i += 1
    if not elastic and (options.min_np != 1 or options.max_np or options.reset_limit != -1):
        raise SystemExit("allreduce-run: --min-np, --max-np and --reset-limit apply to an elastic job: add --elastic")
    return rest, options if elastic else None


def mpirun_flags(options: ElasticOptions, np_: int, passthrough: list[str], *, cores: int = 0) -> list[str]:
    """mpirun flags for ULFM (a user's own ``--mca btl`` wins), and room for replacements."""
    if options.min_np > np_:
        raise SystemExit(f"allreduce-run: --min-np {options.min_np} is more than -np {np_}")
    if options.max_np and options.max_np < np_:
        raise SystemExit(f"allreduce-run: --max-np {options.max_np} is less than -np {np_}")
    flags = ["--with-ft", "ulfm"]
    hosts = any(a in passthrough for a in ("-H", "--host", "--hostfile", "--machinefile"))
    if cores and options.max_np > cores >= np_ and not hosts and "--oversubscribe" not in passthrough:
        flags.append("--oversubscribe")      # above the cores the launcher adds it itself (run.py)
        if "--bind-to" not in passthrough:
            flags += ["--bind-to", "none"]
    if not any(passthrough[i] == "--mca" and passthrough[i + 1] == "btl" for i in range(len(passthrough) - 1)):
        flags += ["--mca", "btl", "tcp,self"]
    return flags


def environment(options: ElasticOptions, environ: dict[str, str]) -> dict[str, str]:
    """The ``ALLREDUCE_*`` settings an elastic job's ranks read (``allreduce.config``)."""
    env = {"ALLREDUCE_ELASTIC": "1", "ALLREDUCE_ELASTIC_MIN_NP": str(options.min_np),
           "ALLREDUCE_ELASTIC_MAX_NP": str(options.max_np)}
    if options.reset_limit != -1 or "ALLREDUCE_ELASTIC_RESET_LIMIT" not in environ:
        env["ALLREDUCE_ELASTIC_RESET_LIMIT"] = str(options.reset_limit)   # the flag wins over the variable
    if "ALLREDUCE_SHM_P2P" not in environ:
        env["ALLREDUCE_SHM_P2P"] = "1"     # mailboxes on, though the BTL is tcp,self (see the module doc)
    if "ALLREDUCE_ELASTIC_JOB" not in environ:       # names the nodes' heartbeat tables (heartbeat.py)
        from .evict import start_time                # pid + start: evict.remove_stale knows a gone launcher
        env["ALLREDUCE_ELASTIC_JOB"] = f"{os.getpid()}-{start_time(os.getpid())}"
    if "PRTE_MCA_state_base_error_non_zero_exit" not in environ:
        env["PRTE_MCA_state_base_error_non_zero_exit"] = "0"   # a rank that raised leaves alone (module doc)
    return env


def finished(line: str) -> bool:
    """Whether ``line`` is rank 0's "run(...) finished with N ranks" (the launcher watches for it)."""
    return _FINISHED.search(line) is not None


def say(text: str) -> None:
    """One ``allreduce-elastic:`` line on stderr, for ``allreduce-run --elastic``'s summary."""
    sys.stderr.write(f"{MARK} {text}\n")
    sys.stderr.flush()


def clock(when: float) -> str:
    """``HH:MM:SS.mmm`` (UTC) of a ``time.time()``."""
    return time.strftime("%H:%M:%S", time.gmtime(when)) + f".{int(when % 1 * 1000):03d}"


@dataclass
class Summary:
    """What the ranks reported, read from their stderr line by line."""

    start: int
    deaths: list[tuple[str, str]] = field(default_factory=list)   # (ranks, when)
    joins: list[tuple[str, str]] = field(default_factory=list)    # (ranks, when spawned)
    events: list[str] = field(default_factory=list)               # both, in the order they came
    finished: int | None = None
    below: bool = False
    stuck: list[str] = field(default_factory=list)                # "who in step for N s", watchdog.py
    raised: list[str] = field(default_factory=list)               # "rank N failed with Type: line", failure.py
    limit: str = ""                                               # "reset limit N reached: ...", failure.py
    evicted: list[str] = field(default_factory=list)              # evict.Eviction.describe(), run.py

    def evict(self, text: str) -> None:
        """The launcher evicted a silent rank (evict.py): said in the summary, in order."""
        self.evicted.append(text)
        self.events.append(f"evicted {text}")

    def feed(self, line: str) -> None:
        if line.startswith(_EVICTED):
            self.evict(line[len(_EVICTED):].strip())
            return
        if MARK not in line:
            return
        if (m := _DIED.search(line)) is not None:
            self.deaths.append((m.group(1), m.group(2)))
            self.events.append(f"{m.group(1)} {'left out (unreachable)' if m.group(3) else 'died'} at {m.group(2)}")
        elif (m := _JOINED.search(line)) is not None:
            self.joins.append((m.group(1), m.group(2)))
            self.events.append(f"{m.group(1)} joined at {m.group(2)}")
        elif (m := _NO_SPAWN.search(line)) is not None:
            self.events.append(f"spawning {m.group(1)} replacement(s) failed")
        elif (m := _FINISHED.search(line)) is not None:
            self.finished = int(m.group(1))
        elif (m := _BELOW.search(line)) is not None:
            self.below = True                # every survivor says it: count the death once
            if m.group(1) and (m.group(1), "") not in self.deaths:
                self.deaths.append((m.group(1), ""))
                self.events.append(f"{m.group(1)} died")
        elif (m := _STUCK.search(line)) is not None:
            self.stuck.append(f"{m.group(1)} in {m.group(2)} for {m.group(3)} s")
        elif (m := _RAISED.search(line)) is not None:
            self.raised.append(f"{m.group(1)} failed with {m.group(2)}")
            self.events.append(self.raised[-1])
        elif not self.limit and (m := _LIMIT.search(line)) is not None:
            self.limit = m.group(1)

    def report(self, code: int) -> tuple[str, int]:
        """The launcher's last line and its exit status, given mpirun's."""
        died = "; ".join(self.events) if self.deaths or self.raised or self.evicted else "; ".join(["no rank died", *self.events])
        if self.stuck:
            return (f"allreduce-run: elastic job aborted: stuck inside Open MPI: {'; '.join(self.stuck)} "
                    f"(ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT bounds each recovery step; docs/11); {died}",
                    code or STUCK_EXIT)
        if self.below:
            return (f"allreduce-run: elastic job stopped below --min-np: {died}", code or BELOW_MIN_EXIT)
        if self.limit:
            return (f"allreduce-run: elastic job stopped: {self.limit}; {died}", code or RESET_LIMIT_EXIT)
        if self.finished is not None:
            size = (f"{self.finished} of {self.start} ranks" if self.finished <= self.start
                    else f"{self.finished} ranks (started with {self.start})")
            return (f"allreduce-run: elastic job finished with {size}; {died}", 0)
        if self.raised:
            return (f"allreduce-run: elastic job failed: no rank finished, {len(self.raised)} raised; {died}",
                    code or 1)
        return (f"allreduce-run: elastic job did not finish (mpirun exited with {code}); {died}", code or 1)
