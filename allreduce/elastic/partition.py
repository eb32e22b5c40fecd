"""Hung across hosts: a heartbeat that crosses hosts, and the majority rule for a cut link.

::

    every process of elastic.run, each BEAT (heartbeat.py's thread calls look()):
      1. send one datagram (job, name, state) to every rank of its world on another host
         (UDP, to the port each rank put in the transport's allgather: transport/liveness.py)
      2. read the datagrams that came: heard[name] = now
      3. a host none of whose ranks was heard for the bound (a cut link, a host down or frozen):
           this side (the ranks of the hosts it still hears, itself included)
             has more than half of the world, or exactly half with the world's rank 0:
               it goes on: each rank of that host is named "unreachable" (one evict line each,
               not killed: the launcher cannot reach it), liveness.cut makes every wait on it
               raise PeerLostError, and the recovery leaves them out (recovery.py: MPI_Comm_create_group
               of this side, not MPI_Comm_shrink, which would wait for them)
             else: this rank stops (exit 6), saying what it heard: the other side goes on
    host  A: ranks 0, 1         B: ranks 2, 3          link of B cut
          A hears 2 of 4, with rank 0: goes on          B hears 2 of 4, without rank 0: stops

Why: a process on a host whose link is cut is alive, and its TCP connections
stay open for minutes (retransmissions), so neither ULFM nor the node's
heartbeat table (/dev/shm, per host) sees anything; each side sees only that
the other went silent. Without a rule both sides would shrink to a world of
their own and train on (split brain: two models, two checkpoints). The
majority rule lets at most one side go on; the tie goes to the side of rank 0
(where the launcher and mpirun usually run: a 2-host job cut in half goes on
where its output goes). A side with less than half stops at once, without
waiting for MPI; when the link comes back, nothing of it is left to rejoin.

Host, not rank: a host counts as cut only when every rank of it is silent; one
silent rank on a host with live peers is that host's heartbeat table's to evict.
And only a host heard from before: if its datagrams never came (UDP blocked, a
name that resolves to loopback here, which is then not watched at all), each
rank says so once and leaves a cut to the waits' timeouts, rather than split
every job at the bound.
The survivors agree without a message: every datagram of a cut host stops at
once, so every rank of the other side finds the same hosts silent, within a
beat of each other (recovery.py waits for its own verdict when a host is
already half-way to the bound).

Open MPI's daemons hang off mpirun: a majority on the side away from mpirun's host
goes on only as long as its daemons keep their ranks after losing mpirun, so keep
rank 0 on mpirun's host (Open MPI's default mapping does) and a tie goes there.
Only a 2-host cut in half is launched (tests/test_cluster.py).

After a partition the job does not regrow (``MPI_Comm_spawn`` could place a
replacement on the host it cannot reach): it goes on below ``--max-np``.

Cost: one datagram of 16 bytes per rank on another host per BEAT (4 Hz), from
every rank; at 64 ranks on 8 hosts, 224 datagrams a second from each.
"""
from __future__ import annotations

import os
import socket
import struct
import time
import zlib

from ..transport import liveness
from . import world
from .launch import MARK

__all__ = ["look", "finish", "goes_on", "cut_ranks", "settle", "unreachable", "PARTITION_EXIT"]

PARTITION_EXIT = 6          #: exit status of a rank on the side of a cut that stops
_FORMAT = struct.Struct("!IiiI")     # job, name, state (1 live, 2 done), sequence
LIVE, DONE = 1, 2

_book: dict[int, tuple[str, tuple[str, int]]] = {}    # name -> (host, (address, port)) of other hosts' ranks
_book_of = None                                        # the Liveness object the book was built from
_heard: dict[int, float] = {}                          # name -> when a datagram of it came last
_done: set[int] = set()                                # names that said they finished
_ever: set[int] = set()                                # names heard at least once (their beats get here)
_warned: set[str] = set()                              # hosts said to be unheard since the start
_cut: dict[int, str] = {}                              # name -> host, declared unreachable
_state = LIVE
_seq = 0
_job = zlib.crc32((os.environ.get("ALLREDUCE_ELASTIC_JOB") or os.environ.get("PMIX_NAMESPACE", "job")
                   .split("@")[0]).encode())


def _liveness():
    from .. import api
    try:
        return getattr(api.communicator().transport, "liveness", None) if api.is_initialized() else None
    except Exception:  # noqa: BLE001 - shut down between the two calls (a recovery, on the main thread)
        return None


def _refresh(now: float) -> None:
    """Rebuild the address book when the library was rebuilt on a new world (the names changed)."""
    global _book, _book_of
    alive = _liveness()
    names = world.names()
    if alive is None or alive is _book_of or len(alive.peers) != len(names):
        return
    me = socket.gethostname()
    book = {}
    for name, (host, _pid, _start), port in zip(names, alive.peers, alive.beat_ports):
        if host != me:
            try:
                address = socket.gethostbyname(host)
            except OSError:
                continue                           # a host name this node cannot resolve: not watched
            if address.startswith("127."):
                continue                           # /etc/hosts maps it to loopback here: not watched
            book[name] = (host, (address, port))
            _heard.setdefault(name, now)           # heard "now": the bound counts from here
    _book, _book_of = book, alive


def _send(state: int) -> None:
    global _seq
    _seq += 1
    sock = liveness.beat_socket()
    data = _FORMAT.pack(_job, world.name(), state, _seq)
    for _host, address in _book.values():
        try:
            sock.sendto(data, address)
        except OSError:
            pass                                   # unreachable now (a cut link): the other side's silence


def _receive(now: float) -> None:
    sock = liveness.beat_socket()
    while True:
        try:
            data = sock.recv(64)
        except OSError:                            # BlockingIOError: nothing more came
            return
        if len(data) != _FORMAT.size:
            continue
        job, name, state, _ = _FORMAT.unpack(data)
        if job != _job:
            continue
        _heard[name] = now
        _ever.add(name)
        if state == DONE:
            _done.add(name)


def look(now: float, bound: float, *, judge: bool, report) -> None:
    """One beat (step 1-3 of the module doc). ``judge``: this process ran in time (heartbeat.py);
    ``report(name, why, fallback)`` writes an evict line."""
    _refresh(now)
    if not _book:
        return
    _send(_state)
    _receive(now)
    if not judge or not bound > 0 or _state == DONE:
        return
    _say_unheard(now, bound)
    silent = _silent_hosts(now, bound)
    if not silent:
        return
    names = world.names()
    lost = {n for n, (host, _) in _book.items() if host in silent}
    side = [n for n in names if n not in lost]
    if goes_on(len(side), len(names), with_rank_0=names[0] in side):
        for name in sorted(lost - set(_cut)):
            host = _book[name][0]
            _cut[name] = host
            report(name, f"unreachable: nothing heard from host {host} for {now - _last(host):.1f} s (a cut "
                         f"link, or the host is down); this side holds {len(side)} of {len(names)} ranks"
                         f"{' with rank 0' if 2 * len(side) == len(names) else ''}, so it goes on without it",
                   False)
        alive = _liveness() or _book_of
        if alive is not None and len(alive.peers) == len(names):      # (host, pid, start): one process
            liveness.cut.update(alive.peers[names.index(n)] for n in lost if n in names)
        return
    me = world.who()
    os.write(2, (f"{MARK} {me} on {socket.gethostname()} is cut off: it hears {len(side)} of {len(names)} ranks "
                 f"(names {', '.join(map(str, side))}), not a majority; nothing from host(s) "
                 f"{', '.join(sorted(silent))} for {bound:g} s; it stops (exit {PARTITION_EXIT}) so that the "
                 "other side goes on alone (no split brain)\n").encode())
    os._exit(PARTITION_EXIT)


def _say_unheard(now: float, bound: float) -> None:
    """Say once per host when none of its beats came within the bound: a cut link to it will be
    found only by the waits' timeouts (``ALLREDUCE_TIMEOUT``)."""
    for host in {h for h, _ in _book.values()} - _warned:
        names = [n for n, (h, _) in _book.items() if h == host]
        if not any(n in _ever for n in names) and min(now - _heard.get(n, now) for n in names) >= bound:
            _warned.add(host)
            os.write(2, (f"{MARK} {world.who()}: no heartbeat datagram came from host {host} in {bound:g} s "
                         "(UDP between the hosts blocked?); a cut link to it is found only by the waits' "
                         "timeouts (ALLREDUCE_TIMEOUT)\n").encode())


def goes_on(side: int, size: int, *, with_rank_0: bool) -> bool:
    """The majority rule: whether a side that holds ``side`` of the world's ``size`` ranks goes on."""
    return 2 * side > size or (2 * side == size and with_rank_0)


def _last(host: str) -> float:
    return max(_heard.get(n, 0.0) for n, (h, _) in _book.items() if h == host)


def _silent_hosts(now: float, bound: float) -> set[str]:
    """Hosts of the world none of whose ranks (that did not finish) was heard for ``bound``. Only
    ranks heard at least once count: a host whose beats never came (UDP blocked between hosts, an
    address that does not reach it) is not judged, or every job there would split at the bound."""
    hosts: dict[str, bool] = {}
    for name, (host, _) in _book.items():
        if name in _done or name not in _ever:
            continue
        quiet = now - _heard.get(name, now) >= bound
        hosts[host] = hosts.get(host, True) and quiet
    return {h for h, quiet in hosts.items() if quiet}


def unreachable() -> dict[int, str]:
    """Names declared unreachable so far, with their host."""
    return dict(_cut)


def cut_ranks(names: list[int]) -> list[int]:
    """Ranks (indices into ``names``) of the world that were declared unreachable."""
    return [i for i, n in enumerate(names) if n in _cut]


def settle(bound: float) -> None:
    """Wait (at most ``bound``) while some host is silent for more than half the bound but no verdict
    is out: a peer of this side may have found it cut a beat earlier than this rank will."""
    end = time.monotonic() + bound
    while _book and time.monotonic() < end and _silent_hosts(time.monotonic(), bound / 2) - set(_cut.values()):
        time.sleep(0.05)


def finish() -> None:
    """This process is done: say so to the other hosts at once (they stop counting its silence)."""
    global _state
    _state = DONE
    if _book:
        _send(DONE)
