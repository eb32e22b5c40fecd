"""Pipeline-parallel schedules: for one pipeline rank, the ordered list of what it does.

The model is cut by layers into ``p * v`` model chunks. Rank ``r`` holds chunks
``r, p + r, 2p + r, ...`` (local chunk ``c`` is model chunk ``c*p + r``, as in Megatron), so
an activation walks ``0 -> 1 -> ... -> p-1 -> 0 -> ...`` round the ranks ``v`` times. The batch is
cut into ``m`` micro-batches. Each rank runs a forward ``F`` and a backward ``B`` of every
micro-batch on every chunk it holds; the schedules differ only in the order::

    gpipe p=4 m=4, slot ->                      1f1b p=4 m=4
    r0 F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3  r0 F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
    r1 .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .   r1 .  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 .
    r2 .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .   r2 .  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .  .
    r3 .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .   r3 .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .

    (the grids of ``allreduce-explain pipeline``, from :func:`stage_actions` via .grid)

``gpipe``: every forward, then every backward (Huang et al. 2019). ``1f1b`` (PipeDream-Flush,
Narayanan et al. 2021): ``p - r - 1`` warm-up forwards, then one forward and one backward in
turn, then the remaining backwards: the same bubble, ``(p-1)/m`` of the compute, but at most
``p - r`` micro-batches' activations alive instead of ``m``. ``interleaved`` (Megatron's
virtual pipeline): ``v >= 2`` chunks a rank; forwards walk micro-batches in groups of ``p``,
chunk 0 of the group, then chunk 1, ...; backwards the same groups with the chunks reversed;
``2(p - r - 1) + (v-1)p`` warm-up forwards (megatron/core/pipeline_parallel/schedules.py,
``get_pp_rank_microbatches``). The bubble shrinks to ``(p-1)/(v m)``; the point-to-point
messages grow ``v`` times. It needs ``p >= 2`` and ``m`` a multiple of ``p`` (full groups).

Communication is written into the list: before ``F`` of any chunk but the model's first, a
``recv_act`` from the previous rank; after ``F`` of any chunk but the last, a ``send_act`` to the
next; before ``B`` of any chunk but the last, a ``recv_grad``; after ``B`` of any but the first,
a ``send_grad``. Sends may complete late (nonblocking); a receive blocks until it arrives.
Every rank's order keeps each chunk's micro-batches ascending in both directions, so the n-th
message on a (chunk, direction) pair matches the n-th receive (FIFO, as MPI is).

Cost (unit F and B): idle slots per rank ``2(p-1)`` of ``2m + 2(p-1)`` for gpipe and 1f1b,
``2(p-1)`` of ``2vm + 2(p-1)`` chunk slots for interleaved; messages per rank per step ``2m``
each way (``2vm`` interleaved).
"""
from __future__ import annotations

import dataclasses

from ..errors import InvalidArgumentError

__all__ = ["Action", "SCHEDULES", "schedule", "stage_actions", "check_arguments", "model_chunk"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
COMPUTE = ("F", "B")
COMM = ("recv_act", "send_act", "recv_grad", "send_grad")


@dataclasses.dataclass(frozen=True)
class Action:
    """One thing a pipeline rank does.

    Attributes:
        kind: ``"F"`` / ``"B"`` (forward / backward of a micro-batch on a chunk) or
            ``"recv_act"``, ``"send_act"``, ``"recv_grad"``, ``"send_grad"``.
        micro_batch: which micro-batch, ``0 .. m-1``.
        chunk: the local chunk, ``0 .. v-1`` (model chunk ``chunk * p + rank``).
        peer: the pipeline rank a send or receive goes to or comes from; ``None`` for compute.
    """
    kind: str
    micro_batch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        where = f" {'to' if self.kind.startswith('send') else 'from'} {self.peer}" if self.peer is not None else ""
        return f"{self.kind}{self.micro_batch}.{self.chunk}{where}"


def check_arguments(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``InvalidArgumentError`` naming what is wrong with a schedule's sizes."""
    if name not in SCHEDULES:
        raise InvalidArgumentError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for what, n in (("stages", p), ("micro_batches", m), ("chunks", v)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"pipeline {what} must be an integer >= 1, got {n!r}")
    if name != "interleaved" and v != 1:
        raise InvalidArgumentError(f"schedule {name!r} runs one chunk a rank, got {v} chunks; "
                                   "use schedule='interleaved' for more")
    if name == "interleaved":
        if v < 2:
            raise InvalidArgumentError(f"the interleaved schedule needs at least 2 chunks a rank, got {v}")
        if p < 2:
            raise InvalidArgumentError("the interleaved schedule needs at least 2 pipeline stages; with 1, "
                                       "use 'gpipe' or '1f1b' (one chunk)")
        if m % p:
            raise InvalidArgumentError(f"the interleaved schedule needs micro_batches a multiple of the "
                                       f"stages (groups of p = {p}), got {m}")


def model_chunk(rank: int, chunk: int, p: int) -> int:
    """The model chunk that local ``chunk`` of pipeline ``rank`` holds (Megatron's layout)."""
    return chunk * p + rank


def schedule(name: str, p: int, m: int, rank: int, v: int = 1) -> list[tuple[str, int, int]]:
    """The compute order of pipeline ``rank``: ``(kind, micro_batch, chunk)`` with kind F or B.

    Args:
        name: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        p: pipeline stages (ranks). m: micro-batches. rank: this rank, ``0 .. p-1``.
        v: chunks a rank (1, or >= 2 for interleaved).
    """
    check_arguments(name, p, m, v)
    if not 0 <= rank < p:
        raise InvalidArgumentError(f"pipeline rank must be in 0..{p - 1}, got {rank}")
    if name == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if name == "1f1b":
        warmup = min(p - rank - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):              # steady state: one forward, then one backward
            order += [("F", warmup + i, 0), ("B", i, 0)]
        return order + [("B", i, 0) for i in range(m - warmup, m)]
    return _interleaved(p, m, v, rank)


def _interleaved(p: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    # virtual micro-batch k: micro-batches in groups of p; inside a group chunk 0 of each, then chunk 1...
    table = [(group + i, c) for group in range(0, m, p) for c in range(v) for i in range(p)]
    total = m * v
    forwards = [("F", i, c) for i, c in table]
    backwards = [("B", i, v - 1 - c) for i, c in table]      # backward walks the chunks in reverse
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = forwards[:warmup]
    for k in range(total - warmup):              # steady state: forward k + warmup, then backward k
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def stage_actions(name: str, p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """:func:`schedule` with the sends and receives written in: what the runtime executes.

    A chunk's activation comes from the rank before it (model chunk ``k - 1``) and goes to the
    rank after it (``k + 1``); the gradient goes the other way. The model's first chunk reads the
    input and its last computes the loss, so they have no receive / send on that side.
    """
    last = p * v - 1
    prev, nxt = (rank - 1) % p, (rank + 1) % p
    out: list[Action] = []
    for kind, i, c in schedule(name, p, m, rank, v):
        k = model_chunk(rank, c, p)
        if kind == "F":
            if k > 0:
                out.append(Action("recv_act", i, c, prev))
            out.append(Action("F", i, c))
            if k < last:
                out.append(Action("send_act", i, c, nxt))
        else:
            if k < last:
                out.append(Action("recv_grad", i, c, nxt))
            out.append(Action("B", i, c))
            if k > 0:
                out.append(Action("send_grad", i, c, prev))
    return out
