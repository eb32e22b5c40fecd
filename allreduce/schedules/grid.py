"""Lay a pipeline schedule out in time: which rank computes what in which slot, and the bubble.

Steps of :func:`simulate`:

1. Take every rank's compute order from :func:`.pipeline.schedule` (the list the runtime runs).
2. Give ``F`` ``forward`` slots and ``B`` ``backward`` slots (default 1 each); messages take none.
3. Start each action as early as both hold: its rank is free (ranks run their list in order), and
   its input exists: ``F`` of micro-batch i on model chunk k needs ``F`` of i on chunk ``k-1``
   finished; ``B`` of i on k needs ``B`` of i on ``k+1`` (on the last chunk, its own ``F``).
   Sends never block (the runtime's sends are nonblocking), so only receives wait.
4. A pass over the ranks that starts nothing while work remains is a deadlock: a schedule bug,
   raised as ``RuntimeError``.

What it counts, per rank: ``busy`` slots, ``idle`` = makespan - busy (the bubble), and the peak
number of (micro-batch, chunk) activations alive, forwarded but not yet backwarded: GPipe keeps
``m``, 1F1B at most ``p``. ``idle / busy`` is what the formula ``(p-1)/(v m)`` predicts (with
``forward == backward``, exactly).

Cost: O(p * m * v) for the whole grid; pure Python, no TensorFlow.
"""
from __future__ import annotations

import dataclasses

from .pipeline import check_arguments, model_chunk, schedule, stage_actions

__all__ = ["Cell", "Grid", "simulate", "peak_live", "check_messages"]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One compute action placed in time: slots ``start .. end-1`` of ``rank``."""
    rank: int
    start: int
    end: int
    kind: str
    micro_batch: int
    chunk: int


@dataclasses.dataclass
class Grid:
    """A simulated schedule: the cells of every rank and what they add up to."""
    name: str
    p: int
    m: int
    v: int
    forward: int
    backward: int
    cells: list[list[Cell]]             # per rank, in time order
    peak: list[int]                     # per rank: peak live (micro-batch, chunk) activations

    @property
    def makespan(self) -> int:
        return max((row[-1].end for row in self.cells if row), default=0)

    def busy(self, rank: int) -> int:
        return sum(c.end - c.start for c in self.cells[rank])

    def idle(self, rank: int) -> int:
        return self.makespan - self.busy(rank)

    def bubble(self, rank: int) -> float:
        """Idle over busy time on ``rank``: what ``(p-1)/(v m)`` predicts."""
        return self.idle(rank) / self.busy(rank)

    @property
    def formula(self) -> float:
        return (self.p - 1) / (self.v * self.m)


def peak_live(order: list[tuple[str, int, int]]) -> int:
    """The most (micro-batch, chunk) activations alive at once along one rank's compute order."""
    live = peak = 0
    for kind, _, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(name: str, p: int, m: int, v: int = 1, *, forward: int = 1, backward: int = 1) -> Grid:
    """Place schedule ``name``'s actions for ``p`` ranks, ``m`` micro-batches, ``v`` chunks a rank.

    Args:
        forward, backward: slots a forward / backward of one chunk takes (Megatron's pictures
            draw backward as 2).

    Returns:
        A :class:`Grid`. Raises ``RuntimeError`` if the schedule deadlocks.
    """
    check_arguments(name, p, m, v)
    if forward < 1 or backward < 1:
        raise ValueError(f"forward and backward take at least one slot, got {forward}, {backward}")
    orders = [schedule(name, p, m, r, v) for r in range(p)]
    last = p * v - 1
    done: dict[tuple[str, int, int], int] = {}          # (kind, micro-batch, model chunk) -> end slot
    free = [0] * p
    at = [0] * p
    cells: list[list[Cell]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while at[r] < len(orders[r]):
                kind, i, c = orders[r][at[r]]
                k = model_chunk(r, c, p)
                need = (("F", i, k - 1) if k > 0 else None) if kind == "F" else \
                    (("B", i, k + 1) if k < last else ("F", i, k))
                if need is not None and need not in done:
                    break                                   # its input has not been made yet
                start = max(free[r], done[need] if need else 0)
                end = start + (forward if kind == "F" else backward)
                done[(kind, i, k)] = free[r] = end
                cells[r].append(Cell(r, start, end, kind, i, c))
                at[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {orders[r][at[r]]}" for r in range(p) if at[r] < len(orders[r]))
            raise RuntimeError(f"schedule {name!r} (p={p}, m={m}, v={v}) deadlocks: {stuck}")
    return Grid(name, p, m, v, forward, backward, cells, [peak_live(o) for o in orders])


def check_messages(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``RuntimeError`` unless every send has exactly one matching receive, in the same order
    on each (sender, receiver, direction, chunk) channel: what FIFO matching on the wire needs."""
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}
    for r in range(p):
        for a in stage_actions(name, p, m, r, v):
            if a.kind in ("send_act", "send_grad"):
                # the receiver's chunk: an activation feeds model chunk k+1, a gradient k-1
                k = model_chunk(r, a.chunk, p) + (1 if a.kind == "send_act" else -1)
                sent.setdefault((r, a.peer, a.kind[5:], k), []).append(a.micro_batch)
            elif a.kind in ("recv_act", "recv_grad"):
                k = model_chunk(r, a.chunk, p)
                received.setdefault((a.peer, r, a.kind[5:], k), []).append(a.micro_batch)
    if sent != received:
        bad = sorted(set(sent) ^ set(received)) or [key for key in sent if sent[key] != received.get(key)]
        raise RuntimeError(f"schedule {name!r} (p={p}, m={m}, v={v}): sends and receives differ on {bad[:4]}")
