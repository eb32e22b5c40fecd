"""Hung, not dead: every process beats; one that stops beating is evicted, and the job goes on.

::

    a table per node, /dev/shm/allreduce-elastic-<job>.beat: one slot per name (world.py)
        slot = pid, start time, beat, state, waited
    every process of elastic.run: a daemon thread, every BEAT (0.25 s)
        1. stamp its beat (CLOCK_MONOTONIC: one clock for every process of a node)
        2. look at every other rank of its world on this node:
           no beat for elastic_hang_timeout seconds (and the process still exists)
             -> one line: "evict rank 1 of 4 (name 1, pid P on H, start T): no heartbeat for 4.1 s ..."
    allreduce-run --elastic (evict.py) reads it, checks pid + start time, SIGKILLs that process
    ULFM sees a death -> every survivor's wait raises PeerLostError -> recovery.py, regrow.py

Why: ULFM declares a process failed when its connections close. A stopped
process (SIGSTOP, a frozen container, a swap storm, a driver stuck with the
GIL held) keeps them open, so MPI never says anything; the survivors wait
until ``ALLREDUCE_TIMEOUT``, and then each blamed itself. The heartbeat comes
from a thread, so it stops only when the whole process stops, or when one
long C call holds the GIL. The second is also how a first-use compile (numba's
LLVM, several seconds on a loaded machine) looks, so a process without a beat
that still uses CPU (its ``/proc`` CPU time moved since the last look), or is
runnable and waiting for a core (state ``R`` on a loaded machine), is busy, not
hung: it is named only once it stops running too. (A loop that spins with
the GIL held is then found only by the waits' timeout.)

The survivors agree without a message: each reads the same table, so each
names the same rank; the launcher acts on the first line about a process
and ignores the repeats. A rank whose own wait timed out (``TransportTimeoutError``:
a silence the heartbeat does not show, such as a deadlock in user code with the
GIL free, or a peer on another host) blames the rank it waited for with
:func:`blame`; if that rank is itself waiting (a chain: its ``waited`` stamp,
written by every check of a slow wait of the caller's threads, not the engine's:
:data:`allreduce.transport.liveness.wait_hook`), it blames the ranks of the node
that are not waiting instead. A named allreduce that failed with
``StallError`` past ``stall_shutdown_time`` blames the ranks it says never submitted
(:func:`blame_stalled`: the same text on every rank that did, so the same ranks).

The bound is ``elastic_hang_timeout`` (``ALLREDUCE_ELASTIC_HANG_TIMEOUT``; 0, the
default, means ``timeout``, ``ALLREDUCE_TIMEOUT``, 30 s). Shorter: a faster
recovery, and a rank that was only slow for longer than the bound is evicted
(it is killed; the job goes on without it, and regrows under ``--max-np``).
A process whose own thread did not run for half the bound (the whole node
stalled) skips one look, so it does not blame peers that stalled with it.

Across hosts (no shared table) the beat travels as a UDP datagram, and a host
whose every rank went silent is judged by a majority rule: :mod:`.partition`,
called from the same thread.

If the process is still there ``FALLBACK`` seconds after a line (no
``allreduce-run`` read it: plain ``mpirun``), the rank that wrote it SIGKILLs it
itself, on its own node, after the same pid + start time check.

Cost: one thread per process that wakes 4 times a second and reads a few
64-byte slots; one float written per check of a slow wait.
"""
from __future__ import annotations

import mmap
import os
import re
import signal
import socket
import threading
import time

import numpy as np

from ..errors import StallError
from ..transport import liveness
from . import partition, world
from .evict import start_time, table_path
from .launch import MARK

__all__ = ["start", "finish", "blame", "blame_stalled", "stalled_ranks", "suspects", "table_path", "BEAT", "FALLBACK"]

BEAT = 0.25            #: seconds between two beats (and two looks)
FALLBACK = 5.0         #: seconds after a line before the reporting rank kills the process itself
SLOTS = 4096           #: names a job may use (a start world and its replacements)
_WORDS = 8             #: float64 words per slot (64 bytes: one cache line)
PID, START, BEAT_AT, STATE, WAITED = range(5)
LIVE, DONE = 1.0, 2.0

_table: np.ndarray | None = None
_me = -1
_bound = 0.0
_reported: dict[int, tuple[int, int, float]] = {}     # name -> (pid, start, when) of lines written
_thread: threading.Thread | None = None


def _open() -> np.ndarray:
    fd = os.open(table_path(), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = SLOTS * _WORDS * 8
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)                   # zeros; two processes doing it at once is harmless
        return np.frombuffer(mmap.mmap(fd, size), dtype=np.float64).reshape(SLOTS, _WORDS)
    finally:
        os.close(fd)


def start(bound: float) -> None:
    """Start beating (idempotent: the first ``elastic.run`` of the process starts the thread)."""
    global _table, _me, _bound, _thread
    _bound = bound
    if _thread is not None:
        return
    _me = world.name()
    if _me >= SLOTS:
        return                                      # more names than slots: this process is not watched
    _table = _open()
    slot = _table[_me]
    slot[PID], slot[START], slot[BEAT_AT] = os.getpid(), start_time(os.getpid()), time.monotonic()
    slot[STATE] = LIVE
    liveness.wait_hook = _waiting
    liveness.describe_rank = _describe
    _thread = threading.Thread(target=_run, name="allreduce-elastic-heartbeat", daemon=True)
    _thread.start()


def finish() -> None:
    """This process is done with the job (finished, or leaving): nobody waits for its beat."""
    if _table is not None and _me >= 0:
        _table[_me][STATE] = DONE
    partition.finish()


def _describe(rank: int) -> str:
    names = world.names()
    return f"rank {rank} (name {names[rank]})" if 0 <= rank < len(names) else f"rank {rank}"


def _waiting() -> None:
    # Only a wait of the caller's threads counts: the engine thread negotiates every cycle whatever
    # the training loop does, so its waits would make a rank stuck in user code look like a waiter.
    if not threading.current_thread().name.startswith("allreduce-engine"):
        _table[_me][WAITED] = time.monotonic()


def _run() -> None:
    last = time.monotonic()
    while True:
        time.sleep(BEAT)
        now = time.monotonic()
        _table[_me][BEAT_AT] = now
        _sample_cpu()
        judge = now - last < _bound / 2             # else this process stalled too: look next time
        if judge:
            for name, silent in suspects(now):
                _report(name, _stale_why(silent))
        partition.look(now, _bound, judge=judge, report=_report)     # the other hosts (partition.py)
        _fall_back(now)
        last = now


def suspects(now: float | None = None) -> list[tuple[int, float]]:
    """``(name, seconds silent)`` of every rank of this process's world, on this node, whose process
    exists, has not beaten for the bound, and used no CPU since the previous look."""
    if _table is None or not _bound > 0:
        return []
    now = time.monotonic() if now is None else now
    found = []
    for name in world.names():
        if name == _me or not 0 <= name < SLOTS:
            continue
        slot = _table[name]
        if slot[STATE] != LIVE or now - slot[BEAT_AT] < _bound:
            continue
        if start_time(int(slot[PID])) != int(slot[START]):     # gone: a dead one is ULFM's
            continue
        if name in _busy:                                       # it runs: busy holding the GIL, not hung
            continue
        found.append((name, now - slot[BEAT_AT]))
    return found


_cpu: dict[int, int] = {}            # name -> its CPU ticks at the heartbeat thread's last look
_busy: set[int] = set()              # names whose CPU ticks moved between the last two looks


def _sample_cpu() -> None:
    """The heartbeat thread's look at every peer's CPU time (``suspects`` reads the result)."""
    for name in world.names():
        if name == _me or not 0 <= name < SLOTS or _table[name][STATE] != LIVE:
            continue
        ticks, state = _cpu_ticks(int(_table[name][PID]))
        if _cpu.get(name, ticks) != ticks or state == b"R":     # ran, or runnable: waits for a core
            _busy.add(name)
        else:
            _busy.discard(name)
        _cpu[name] = ticks


def _cpu_ticks(pid: int) -> tuple[int, bytes]:
    """utime + stime of ``pid`` in clock ticks, and its state letter (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12]), fields[0]
    except (OSError, IndexError, ValueError):
        return -1, b"?"


def blame(peer: int, exc: BaseException) -> list[int]:
    """This rank's wait for rank ``peer`` timed out (``exc``): name the silent rank(s) for eviction.

    Returns:
        The names reported: the node's silent ranks if any; else ``peer``'s; and if the table shows
        ``peer`` waiting itself (a chain), the ranks of this node that are not waiting, when some are.
    """
    stale = suspects()
    for name, silent in stale:
        _report(name, _stale_why(silent))
    if stale:
        return [name for name, _ in stale]
    names = world.names()
    if not 0 <= peer < len(names):
        return []
    name = names[peer]
    if _is_waiting(name):
        # It waits too (a chain): the silent one is a rank of this node that is not waiting, if some
        # (but not every) other rank is not waiting; else the culprit is on another node, for others.
        idle = [n for n in names if n != _me and n < SLOTS and _table[n][STATE] == LIVE and not _is_waiting(n)]
        if not 0 < len(idle) < len(names) - 1:
            return []
        for n in idle:
            _report(n, f"did not answer while the others waited (ALLREDUCE_TIMEOUT: {type(exc).__name__} "
                       "waiting for a rank that waited for it)")
        return idle
    from .. import api
    timeout = api.communicator().config.timeout if api.is_initialized() else 0.0
    _report(name, f"did not answer for {timeout:g} s (ALLREDUCE_TIMEOUT: {type(exc).__name__} waiting for it)")
    return [name]


_NEVER_BY = re.compile(r"after stall_shutdown_time=([\d.]+) s: submitted by rank\(s\) [\d, ]+, never by rank\(s\) ([\d, ]+)\.")


def stalled_ranks(exc: BaseException) -> tuple[list[int], str]:
    """The ranks a ``StallError`` past ``stall_shutdown_time`` says never submitted, and the limit;
    ([], "") for anything else (an out-of-step ``StallError`` blames nobody: every rank waits there)."""
    match = _NEVER_BY.search(str(exc)) if isinstance(exc, StallError) else None
    return ([int(r) for r in match.group(2).split(", ")], match.group(1)) if match else ([], "")


def blame_stalled(ranks: list[int], limit: str) -> list[int]:
    """This rank's named allreduce stalled past ``stall_shutdown_time``: name the ranks that never
    submitted it (every rank that did gets the same error text, so all name the same ranks). No
    "waiting" check here: the stalled rank's engine thread goes on negotiating, so it stamps."""
    names, me, blamed = world.names(), _me, []
    for rank in ranks:
        if 0 <= rank < len(names) and names[rank] != me:
            _report(names[rank], f"never submitted a tensor the others did, within stall_shutdown_time "
                                 f"({limit} s, ALLREDUCE_STALL_SHUTDOWN_TIME: StallError)")
            blamed.append(names[rank])
    return blamed


def _is_waiting(name: int) -> bool:
    """Whether the table shows ``name`` inside a slow wait of its own threads (stamped < 2 s ago)."""
    return (_table is not None and name < SLOTS and _table[name][STATE] == LIVE
            and time.monotonic() - _table[name][WAITED] < 2.0)


def _stale_why(silent: float) -> str:
    return (f"no heartbeat for {silent:.1f} s (stopped, hung or swapping; the bound is elastic_hang_timeout, "
            f"{_bound:g} s, ALLREDUCE_ELASTIC_HANG_TIMEOUT)")


def _report(name: int, why: str, fallback: bool = True) -> None:
    if name in _reported:
        return
    names = world.names()
    if name not in names:
        return
    rank = names.index(name)
    host, pid, start_ = _where(name, rank)
    if pid <= 0:
        return
    _reported[name] = (pid, start_ if fallback else 0, time.monotonic())   # start 0: no fallback kill
    me = names.index(_me) if _me in names else -1
    # os.write: the main thread may hold sys.stderr's lock (it may be the one stuck)
    os.write(2, (f"{MARK} evict rank {rank} of {len(names)} (name {name}, pid {pid} on {host}, start {start_}): "
                 f"{why}; seen by rank {me} (name {_me})\n").encode())


def _where(name: int, rank: int) -> tuple[str, int, int]:
    """Host, pid and start time of rank ``rank`` (name ``name``): the node's table, else the transport's
    allgather (a rank on another host)."""
    if _table is not None and name < SLOTS and _table[name][STATE] == LIVE and _table[name][PID] > 0:
        return socket.gethostname(), int(_table[name][PID]), int(_table[name][START])
    from .. import api
    if api.is_initialized():
        peers = getattr(api.communicator().transport.liveness, "peers", None)
        if peers and rank < len(peers):
            return peers[rank]
    return "", 0, 0


def _fall_back(now: float) -> None:
    """Kill what the launcher did not, FALLBACK s after the line (same node only: pid + start time)."""
    for name, (pid, start_, when) in list(_reported.items()):
        if now - when >= FALLBACK and start_time(pid) == start_ and start_:
            try:
                os.kill(pid, signal.SIGKILL)
                os.write(2, f"{MARK} rank (name {_me}) SIGKILLed name {name} (pid {pid}) itself: no launcher "
                            f"evicted it within {FALLBACK:g} s\n".encode())
            except OSError:
                pass
            _reported[name] = (pid, 0, when)
