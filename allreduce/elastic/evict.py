"""The launcher's side of an eviction: read a rank's "evict" line, SIGKILL that process by pid.

::

    a survivor (heartbeat.py):  allreduce-elastic: evict rank 1 of 4 (name 1, pid 4242 on host-a,
                                start 918273): no heartbeat for 4.1 s (...); seen by rank 0 (name 0)
    allreduce-run --elastic:    the pid's /proc/<pid>/stat start time is 918273?  (the same process,
                                not a reused pid; a process of another kernel never matches)
                                  yes -> SIGKILL, one line "allreduce-run: evicted rank 1 of 4 (name 1) ..."
                                  no  -> nothing (it ended already, or it runs on another host:
                                         there the survivor that wrote the line kills it, heartbeat.py)

Every survivor on the node writes the same line (they read the same table);
the first one is acted on and the rest are ignored (:class:`Evictor` keeps the
pids it has seen). Open MPI then sees a death, and the survivors recover as
after any death. The summary's last line names each evicted rank, why, and
after how long (:class:`~allreduce.elastic.launch.Summary`).

A stopped process dies of SIGKILL at once (SIGKILL is never blocked and needs no
SIGCONT). The launcher of a namespace cluster (``allreduce-cluster``) shares the
hosts' kernel, so it reaches every rank this way.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
from dataclasses import dataclass

from .launch import MARK

__all__ = ["Evictor", "Eviction", "parse", "start_time", "table_path", "remove_tables", "remove_stale",
           "EVICTED"]

EVICTED = "allreduce-run: evicted "      #: the launcher's line for each eviction (Summary reads it back)

_LINE = re.compile(re.escape(MARK) + r" evict rank (\d+) of (\d+) \(name (\d+), pid (\d+) on (\S*), start (\d+)\): "
                   r"(.*); seen by (rank -?\d+ \(name \d+\))\s*$")


@dataclass
class Eviction:
    rank: int                  #: its rank in the world it was evicted from
    size: int                  #: that world's size
    name: int                  #: its name (rank in the starting world, or replacement number: world.py)
    pid: int
    host: str
    start: int                 #: /proc start time in clock ticks (with pid: one process)
    why: str
    seen_by: str
    killed: bool = False

    @property
    def unreachable(self) -> bool:
        """Named by the other side of a cut link (partition.py): this launcher cannot reach it either."""
        return self.why.startswith("unreachable")

    def describe(self) -> str:
        """``rank 1 of 4 (name 1, pid 4242 on host-a) with SIGKILL: why`` (after ``evicted``)."""
        how = ("with SIGKILL" if self.killed else "left out, not killed (the other side of the cut stops itself)"
               if self.unreachable else "not here (no such process on this host: the rank that named it kills it)")
        return f"rank {self.rank} of {self.size} (name {self.name}, pid {self.pid} on {self.host}) {how}: {self.why}"


def start_time(pid: int) -> int:
    """Start of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), 0 if none.
    (The launcher must not import mpi4py, so this is not ``transport.liveness.start_time``'s import.)"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def table_path(environ=os.environ, host: str | None = None) -> str:
    """The heartbeat table of this job on this node (heartbeat.py): the launcher's key
    (``ALLREDUCE_ELASTIC_JOB``), else Open MPI's job name without its ``@N`` (spawned replacements
    are jobs ``@2``, ``@3``, ... of the same run), and the host's name (``host``, default this one's):
    hosts that share a /dev/shm, as a namespace cluster's do, each keep their own table."""
    return f"/dev/shm/allreduce-elastic-{_job(environ)}.{_safe(host or socket.gethostname())}.beat"


def _job(environ) -> str:
    return _safe(environ.get("ALLREDUCE_ELASTIC_JOB") or environ.get("PMIX_NAMESPACE", "job").split("@")[0])


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def remove_tables(environ=os.environ, directory: str = "/dev/shm") -> None:
    """Remove this job's heartbeat tables, every host's (the launcher's clean-up at the end)."""
    prefix = f"allreduce-elastic-{_job(environ)}."
    for entry in os.listdir(directory):
        if entry.startswith(prefix) and entry.endswith(".beat"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, entry))


_KEY = re.compile(r"allreduce-elastic-(\d+)-(\d+)\.[\w-]*\.beat")


def remove_stale(directory: str = "/dev/shm") -> list[str]:
    """Remove the heartbeat tables of launchers that are gone (a launcher killed before its own
    clean-up): a table named by ``allreduce-run``'s key, ``<pid>-<start time>.<host>``, whose pid is not
    that process any more. Tables under another key (``ALLREDUCE_ELASTIC_JOB`` given by the user,
    plain mpirun's job name) are left alone. Returns the paths removed."""
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        match = _KEY.fullmatch(entry)
        if match and start_time(int(match.group(1))) != int(match.group(2)):
            try:
                os.unlink(os.path.join(directory, entry))
                removed.append(os.path.join(directory, entry))
            except OSError:
                pass                      # another launcher removed it first, or not ours to remove
    return removed


def parse(line: str) -> Eviction | None:
    """The eviction a rank's line asks for, or None."""
    match = _LINE.search(line)
    if match is None:
        return None
    rank, size, name, pid, host, start, why, seen = match.groups()
    return Eviction(int(rank), int(size), int(name), int(pid), host, int(start), why, seen)


class Evictor:
    """Acts on each eviction line once (thread-safe: the launcher's relay thread feeds it)."""

    def __init__(self):
        self.done: list[Eviction] = []
        self._seen: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def feed(self, line: str) -> Eviction | None:
        """Kill the process ``line`` names, if it is a new one here; return what was done."""
        wanted = parse(line)
        if wanted is None:
            return None
        with self._lock:
            if (wanted.pid, wanted.start) in self._seen:
                return None
            self._seen.add((wanted.pid, wanted.start))
            if wanted.start and start_time(wanted.pid) == wanted.start and not wanted.unreachable:
                try:
                    os.kill(wanted.pid, signal.SIGKILL)
                    wanted.killed = True
                except OSError:
                    pass
            self.done.append(wanted)
            return wanted
