"""A bound on every blocking MPI step of a recovery or a regrow: no survivor waits forever.

::

    main thread (run(), recovery, regrow)          watchdog thread (one per process, a daemon)
    with watchdog.step("MPI_Comm_shrink", ...):     every 0.2 s: is an armed step past its bound?
        world.Shrink()     <- stuck inside MPI        no  -> sleep
                                                      yes -> say which step, on which rank, how
                                                             long, and why it may be; then
                                                             MPI_Abort the whole job

Why: Open MPI 5.0.11's fault tolerance (ULFM) over its tcp BTL can deadlock a
survivor inside MPI. When a dead peer's socket closes while a collective's
rendezvous message from that peer waits unmatched, the tcp receive path holds
the endpoint's send lock, marks the peer failed, revokes the collectives, and
tries to NACK that message over the same endpoint: it waits on a lock it holds
(``mca_btl_tcp_frag_recv -> ompi_errhandler_proc_failed_internal ->
ompi_comm_revoke_local -> mca_pml_ob1_revoke_comm ->
mca_pml_ob1_recv_request_ack_send_btl -> mca_btl_tcp_endpoint_send``). The other
survivors then wait for it in ``MPI_Comm_shrink``'s agreement. No Python runs
in a thread stuck inside MPI, and nothing there can be cancelled (revoking the
communicator of a stuck MPI_Intercomm_merge did not free it), so only another
thread can notice, and only ending the job frees the ranks: this one does.
(The library no longer sends such messages itself under ``--elastic``:
``algorithms/native.py`` keeps MPI's collective messages eager; a user's own
large MPI collectives still can.)

The bound is ``Config.elastic_recovery_timeout`` (``ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT``,
seconds, default 120; 0 turns the watchdog off), per step. The abort line names
the step and says "stuck inside Open MPI", which ``allreduce-run --elastic``
repeats in its summary; every rank exits, the launcher exits non-zero. Cost:
one sleeping thread; a step costs two list operations under a lock.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .launch import MARK, STUCK_EXIT

__all__ = ["step", "STUCK_EXIT", "POLL", "ULFM_DEADLOCK", "test_hook"]

POLL = 0.2              #: seconds between two looks of the watchdog thread
ABORT_GRACE = 15.0      #: seconds MPI_Abort gets to end the job before this process ends it harder
ULFM_DEADLOCK = "Open MPI's ULFM over tcp can deadlock a survivor after a death"   #: the usual cause
#: Called with the step's name as each step starts (tests/mpi/elastic_train.py: a rank stuck in a step).
test_hook: Callable[[str], None] | None = None


@dataclass(eq=False)
class _Step:
    what: str
    who: str
    timeout: float
    started: float
    comm: Any                                    # what MPI_Abort ends (every rank of it)
    why: str
    deadline: float = field(init=False)

    def __post_init__(self):
        self.deadline = self.started + self.timeout


_lock = threading.Lock()
_armed: list[_Step] = []
_thread: threading.Thread | None = None


@contextlib.contextmanager
def step(what: str, *, timeout: float, who: str, comm: Any = None, why: str = ULFM_DEADLOCK) -> Iterator[None]:
    """Run the body as one bounded step (see the module doc).

    Args:
        what: the step, as the abort line names it (``MPI_Comm_shrink``).
        timeout: seconds the body may take (0: no bound).
        who: this process, for the abort line (``rank 1 (name 3)``).
        comm: the communicator whose every rank the abort ends (default ``COMM_WORLD``).
        why: the likely cause, for the abort line.
    """
    if not timeout > 0:
        if test_hook is not None:
            test_hook(what)
        yield
        return
    armed = _Step(what, who, timeout, time.monotonic(), comm, why)
    with _lock:
        _armed.append(armed)
        _start()
    try:
        if test_hook is not None:
            test_hook(what)
        yield
    finally:
        with _lock:
            _armed.remove(armed)


def _start() -> None:
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_watch, name="allreduce-elastic-watchdog", daemon=True)
        _thread.start()


def _watch() -> None:
    while True:
        time.sleep(POLL)
        now = time.monotonic()
        with _lock:
            late = next((s for s in _armed if now > s.deadline), None)
        if late is not None:
            _abort(late, now)


def _say(text: str) -> None:
    # os.write, not sys.stderr: the stuck thread may hold the stream's lock
    os.write(2, f"{MARK} {text}\n".encode())


def _abort(stuck: _Step, now: float) -> None:
    """Name the step, then end every rank: MPI_Abort, and if that is stuck too, harder."""
    _say(f"{stuck.who} stuck inside Open MPI in {stuck.what} for {now - stuck.started:.0f} s "
         f"({stuck.why}; the bound is elastic_recovery_timeout, {stuck.timeout:g} s, "
         "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT); aborting the job (docs/11-when-a-rank-dies.md)")
    threading.Timer(ABORT_GRACE, _end_harder).start()
    from mpi4py import MPI
    comm = stuck.comm if stuck.comm is not None else MPI.COMM_WORLD
    comm.Abort(STUCK_EXIT)


def _end_harder() -> None:
    """MPI_Abort did not end this process: stop the launcher's daemon (its parent), which ends
    the job, then this process."""
    with contextlib.suppress(OSError):
        os.kill(os.getppid(), signal.SIGTERM)
    os._exit(STUCK_EXIT)
