"""The stall inspector: names tensors that some ranks submitted and others did not.

A classic distributed-training hang: rank 1 skips a layer (a branch in the
model, a parameter without a gradient), so ``"layer7/w"`` is never submitted
there, and every other rank waits for it forever. The negotiation already
knows, on every rank, which ranks are ready for each pending name (the
rank masks in negotiation.py), so finding the culprit costs nothing extra.

Rank 0 inspects, once per cycle, before the cycle's exchange:

* after ``stall_check_time`` seconds (``ALLREDUCE_STALL_CHECK_TIME``,
  default 60, 0 = off) it logs a warning (logger ``allreduce.engine``; with
  no logging configured Python prints it to stderr) naming each stalled
  tensor, the ranks that submitted it and the ranks missing; again every
  ``stall_check_time`` while it lasts;
* out of step: when every rank has submitted some name that another rank
  lacks (each rank is waiting for a different tensor: one rank failed a
  step and moved on, or the ranks call collectives in different orders),
  for ``out_of_step_time`` seconds (``ALLREDUCE_OUT_OF_STEP_TIME``, default 5,
  0 = off), no rank can go on. Rank 0 then sends the
  cutoff at once, whatever ``stall_shutdown_time`` says, and every rank
  fails every partial name with a ``StallError`` that says the ranks are
  out of step and who waits for what (:func:`out_of_step`), instead of
  hanging until the stall limit;
* after ``stall_shutdown_time`` seconds (``ALLREDUCE_STALL_SHUTDOWN_TIME``,
  default 600, 0 = never) it sends a cutoff cycle in the next exchange: every
  rank fails every name that has been partial since that cycle or earlier
  with ``StallError``, in the same cycle. Deciding on rank 0's clock and
  sending a cycle number (not a time) keeps every rank's decision the same.
"""
from __future__ import annotations

import logging
import time

from ..errors import StallError

__all__ = ["StallInspector", "stall_message", "stall_error", "out_of_step"]

log = logging.getLogger("allreduce.engine")

def out_of_step(partial: dict, size: int) -> str | None:
    """Who waits for what, when every rank has submitted a name that some rank lacks; else None.

    Args:
        partial: the negotiator's replicated ``name -> (since cycle, since time, ready ranks)``,
            so every rank computes the same answer.
    """
    waiting = frozenset().union(*(entry[2] for entry in partial.values())) if partial else frozenset()
    if len(waiting) < size:
        return None                              # some rank waits for nothing here: it may still come
    shown = "; ".join(f"{name!r} submitted by rank(s) {', '.join(map(str, sorted(entry[2])))}, "
                      f"missing on rank(s) {', '.join(str(r) for r in range(size) if r not in entry[2])}"
                      for name, entry in sorted(partial.items())[:6])
    return (f"the ranks are out of step: every rank waits for a tensor that another rank has not submitted "
            f"({shown}). A rank probably failed a step and went on to other collectives; every rank must "
            "run the same collectives in the same order")


def stall_message(name: str, ready: list[int], missing: list[int], seconds: float) -> str:
    return (f"allreduce engine: tensor {name!r} has waited {seconds:.1f} s: submitted by rank(s) "
            f"{', '.join(map(str, ready))}, missing on rank(s) {', '.join(map(str, missing))}. "
            "Every rank must submit every name; check for branches that skip a tensor on some ranks.")


def stall_error(name: str, ready: list[int], missing: list[int], limit: float,
                out_of_step: str | None = None) -> StallError:
    """The error every rank raises for a stalled name (the same text everywhere)."""
    if out_of_step is not None:
        return StallError(f"allreduce of {name!r} failed: {out_of_step}.")
    return StallError(f"allreduce of {name!r} failed after stall_shutdown_time={limit:g} s: submitted by "
                      f"rank(s) {', '.join(map(str, ready))}, never by rank(s) {', '.join(map(str, missing))}. "
                      "Every rank must submit every name; check for branches that skip a tensor on some ranks.")


class StallInspector:
    """Rank 0's watch over partially submitted names."""

    def __init__(self, rank: int, size: int, *, check_time: float, shutdown_time: float,
                 out_of_step_time: float = 5.0):
        self.rank, self.size = rank, size
        self.check_time, self.shutdown_time = check_time, shutdown_time
        # A tfops op blocks until its name is reduced, so there the out-of-step state never resolves
        # itself; ranks that submit asynchronously in different orders pass through it, briefly.
        self.out_of_step_time = out_of_step_time
        self._warned: dict[str, float] = {}
        self._stuck_since: float | None = None   # since when every rank waits for a partial name

    def inspect(self, partial: dict[str, tuple[int, float, frozenset[int]]]) -> int:
        """Warn about stalled names; return the stall cutoff cycle, or -1 for none.

        Args:
            partial: the negotiator's replicated ``name -> (since cycle, since time, ready ranks)``.

        Returns:
            The latest cycle such that every name partial since then or earlier is
            past ``stall_shutdown_time`` (rank 0 only; -1 elsewhere or when none is).
        """
        if self.rank != 0 or not partial:
            self._warned.clear()
            self._stuck_since = None
            return -1
        now = time.monotonic()
        if self.out_of_step_time <= 0 or out_of_step(partial, self.size) is None:
            self._stuck_since = None
        elif self._stuck_since is None:
            self._stuck_since = now
        elif now - self._stuck_since >= self.out_of_step_time:
            return max(since for since, _, _ in partial.values())     # fail every partial name now
        everyone = set(range(self.size))
        for name in list(self._warned):
            if name not in partial:
                del self._warned[name]
        cutoff = -1
        for name, (since, t0, ranks) in partial.items():
            age = now - t0
            if self.check_time > 0 and age >= self.check_time \
                    and now - self._warned.get(name, -float("inf")) >= self.check_time:
                self._warned[name] = now
                message = stall_message(name, sorted(ranks), sorted(everyone - ranks), age)
                log.warning(message)
            if self.shutdown_time > 0 and age >= self.shutdown_time:
                cutoff = max(cutoff, since)
        return cutoff
