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
* after ``stall_shutdown_time`` seconds (``ALLREDUCE_STALL_SHUTDOWN_TIME``,
  default 0 = never) it sends a cutoff cycle in the next exchange: every
  rank fails every name that has been partial since that cycle or earlier
  with ``StallError``, in the same cycle. Deciding on rank 0's clock and
  sending a cycle number (not a time) keeps every rank's decision the same.
"""
from __future__ import annotations

import logging
import time

from ..errors import StallError

__all__ = ["StallInspector", "stall_message", "stall_error"]

log = logging.getLogger("allreduce.engine")


def stall_message(name: str, ready: list[int], missing: list[int], seconds: float) -> str:
    return (f"allreduce engine: tensor {name!r} has waited {seconds:.1f} s: submitted by rank(s) "
            f"{', '.join(map(str, ready))}, missing on rank(s) {', '.join(map(str, missing))}. "
            "Every rank must submit every name; check for branches that skip a tensor on some ranks.")


def stall_error(name: str, ready: list[int], missing: list[int], limit: float) -> StallError:
    """The error every rank raises for a stalled name (the same text everywhere)."""
    return StallError(f"allreduce of {name!r} failed after stall_shutdown_time={limit:g} s: submitted by "
                      f"rank(s) {', '.join(map(str, ready))}, never by rank(s) {', '.join(map(str, missing))}. "
                      "Every rank must submit every name; check for branches that skip a tensor on some ranks.")


class StallInspector:
    """Rank 0's watch over partially submitted names."""

    def __init__(self, rank: int, size: int, *, check_time: float, shutdown_time: float):
        self.rank, self.size = rank, size
        self.check_time, self.shutdown_time = check_time, shutdown_time
        self._warned: dict[str, float] = {}

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
            return -1
        now = time.monotonic()
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
