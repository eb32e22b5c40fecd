"""When the engine's cycles run: early on a burst of submits, stretched while idle.

Cycles are at most ``cycle_time`` apart while work is pending, and start
early when work comes: a submit wakes the engine, which waits until submits
pause for ``BURST_GAP`` x ``cycle_time`` (0.2 ms at the default 1 ms), or
until a caller blocks on a handle, and then runs a cycle. Tensors submitted
back to back therefore fuse, and a lone tensor's round trip is one
negotiation and one allreduce, not a whole cycle (Horovod's fixed cycle
costs ~1 ms here).

Idle: after ``IDLE_CYCLES`` cycle with nothing pending on any rank (a count
every rank shares), cycles stretch to ``IDLE_FACTOR`` x ``cycle_time``. This
matters in training: between two steps' gradients the ranks compute for
milliseconds, and a 1 ms cycle would interrupt that compute with a tiny
exchange every millisecond (on the 2-core VM, 8 of them per step cost 20%
of the step). No tensor waits for the stretch: a rank's submit wakes its own
engine, so a cycle starts once the last rank has submitted, which is as soon
as any cycle could agree on the tensor. Only a tensor that some rank never
submits waits up to one stretched cycle before the stall inspector sees it.
While a caller is blocked on a handle, cycles come every ``BURST_GAP`` x
``cycle_time``: a cycle that met a peer not yet ready (it was in a cycle for
other work) must not make the next try wait a whole period.

:class:`Pacer` holds that state for one engine. Submitting threads call
:meth:`Pacer.submitted`, a thread that blocks on a handle calls
:meth:`Pacer.hurry`, and the engine thread sleeps in :meth:`Pacer.pause`
between its cycles.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["Pacer", "tight_timer_slack", "IDLE_CYCLES", "IDLE_FACTOR", "BURST_GAP"]

_monotonic = time.monotonic   # a module global: one attribute lookup less per submit

IDLE_CYCLES = 1      # one cycle with nothing pending anywhere, and cycles stretch
IDLE_FACTOR = 20
BURST_GAP = 0.2      # x cycle_time: a cycle starts once submits have paused this long


def tight_timer_slack() -> None:
    """Let this thread's short sleeps end on time (Linux): the default 50 us timer slack adds
    that much to every pause of the cycle, which a 0.2 ms burst gap cannot afford."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)   # PR_SET_TIMERSLACK, 1 us
    except (OSError, AttributeError):
        pass


class Pacer:
    """The cycle clock of one engine: ``period`` seconds (its ``cycle_time``), and its wake-ups."""

    def __init__(self, period: float):
        self.period = period
        self._wake = threading.Event()
        self._last_submit = 0.0
        self._waited = False              # a caller blocks on a queued handle: its burst is over
        self._blocked = 0                 # callers blocked on handles right now
        self._blocked_lock = threading.Lock()

    def submitted(self) -> None:
        """A tensor was queued (any thread): wake the engine, which waits for the burst to end."""
        self._last_submit = _monotonic()
        if not self._wake.is_set():          # Event.set takes a lock and notifies: only when it is needed
            self._wake.set()

    def wake(self) -> None:
        """End the engine's pause now (shutdown)."""
        self._wake.set()

    def hurry(self, delta: int) -> None:
        """A caller blocks on a handle (+1; -1 when it returns). It submits nothing more meanwhile,
        so start the cycle now; and while it waits, cycles come every ``BURST_GAP`` x
        ``cycle_time``, not every ``cycle_time``: a cycle that found a peer not yet ready must
        not cost the next one a whole period (a 4-byte round trip took 1.3 ms that way, by hand).
        """
        with self._blocked_lock:
            self._blocked += delta
        if delta > 0:
            self._waited = True
            self._wake.set()

    def pause(self, start: float, *, idle: int, stopping: Callable[[], bool], served: bool = False) -> None:
        """Sleep after the cycle that began at ``start`` (``time.monotonic()``) until the next one.

        The next cycle is due one period after ``start``: ``BURST_GAP`` periods while a caller
        blocks, ``IDLE_FACTOR`` once ``idle`` (cycles with nothing pending anywhere) reaches
        ``IDLE_CYCLES``. It comes earlier when a burst of submits has ended: when no submit
        came for ``BURST_GAP`` periods, or at once when a caller blocks on a handle (a thread
        that waits submits nothing meanwhile). Tensors submitted back to back (a loop, a
        backward pass) still go into one cycle and fuse, while a lone tensor starts its cycle
        as soon as its caller waits for it, not after the whole period. ``stopping()`` True
        ends the pause.

        ``served``: the cycle completed handles. Their callers still count as blocked until they
        run again, so the next cycle waits at least ``BURST_GAP`` periods from now (or a submit
        burst's end, or a new waiter) instead of starting at once: it would find nothing to do,
        cost an exchange with every peer, and hold the GIL the released callers need. -np 2,
        1000 x 4 KiB back to back: one negotiation exchange per burst instead of three.
        """
        factor = BURST_GAP if self._blocked else IDLE_FACTOR if idle >= IDLE_CYCLES else 1
        deadline, gap = start + self.period * factor, self.period * BURST_GAP
        if served:
            deadline = max(deadline, time.monotonic() + gap)
        woke = self._wake.wait(max(0.0, deadline - time.monotonic()))
        if stopping():
            return
        self._wake.clear()
        while woke:
            if self._waited or stopping():
                self._waited = False
                return
            now = time.monotonic()
            quiet = now - self._last_submit
            if quiet >= gap or now >= deadline:
                return
            self._wake.wait(min(gap - quiet, deadline - now))   # a submit or a waiter ends it early
            self._wake.clear()
