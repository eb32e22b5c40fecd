"""Run a real collective on thread ranks with symbolic contents, and cut the run into steps.

The trick: Sum over int64 where rank r's every element is ``1 << r``. Since
each contribution is added once, every element is at every moment the
*bitmask of the ranks whose contributions it holds*: 0b0101 is "a + c".
Letters name ranks (a = rank 0, b = rank 1, ...), digits name chunks, so
``a1+b1+c1`` is chunk 1 summed over ranks 0, 1 and 2.

A bitmask cannot show a contribution added twice (a + a = b), so the same
run is repeated with every element 1: there each element counts its
contributions, and a count that differs from the popcount of the mask is a
double count, flagged as an error.

Chunks are read off the run itself: the buffer is cut wherever a message or
a reduction starts or ends, or where neighbouring elements ever hold
different sets; the pieces are numbered like ``partition.chunks`` when they
coincide with it (ring's chunks do), else 0, 1, ... in buffer order.
"""
from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import algorithms, partition
from ..buffers import Workspace
from ..ops import Op
from ..transport import shared
from ..transport.threads import ThreadWorld, run_threads
from .recorder import START, Message, Recording, RecordingTransport, patch_kernels

__all__ = ["COLLECTIVES", "MAX_RANKS", "Trace", "explain", "letters", "Unavailable"]

MAX_RANKS = 26          # one letter per rank
#: shm on a registered buffer (``Communicator.shared_empty``): each rank's buffer lives in shared memory
REGISTERED = "shm-reg"

def _allreduce_function(name: str) -> Callable:
    """The allreduce function behind ``name`` (``shm-reg`` is ``shm``, given registered buffers)."""
    return algorithms.get("shm" if name == REGISTERED else name)


COLLECTIVES = {         # collective -> the algorithms it accepts (allreduce: every registered one)
    "allreduce": algorithms.NAMES + (REGISTERED,),
    "broadcast": ("binomial", "scatter-allgather"),
    "allgather": ("ring",),
    "reducescatter": ("ring",),
    "alltoall": ("pairwise",),
}


class Unavailable(RuntimeError):
    """The algorithm exists by name but cannot run on in-process thread ranks here."""


def letters(mask: int, label: str = "") -> str:
    """``letters(0b101, "1")`` -> ``"a1+c1"``; an empty set is ``"."``."""
    names = [chr(ord("a") + r) + label for r in range(mask.bit_length()) if mask >> r & 1]
    return "+".join(names) if names else "."


@dataclass
class Trace:
    """A recorded run, cut into steps. ``states[i][r]`` is rank r's buffer (masks) after step i-1;
    ``states[0]`` is the start."""

    collective: str
    algorithm: str
    p: int
    count: int
    steps: list[tuple[str, int]]
    states: list[list[np.ndarray]]
    counts: list[list[np.ndarray]]          # the all-ones run: contributions per element
    step_messages: list[list[Message]]
    atoms: list[tuple[int, int]]            # (offset, size) of each chunk shown
    labels: list[str]
    recording: Recording
    expected: list[np.ndarray]              # final masks each rank must hold
    segment_bytes: int = 256 << 10          # the pipeline segment the run was given

    def atom_masks(self, state: np.ndarray) -> list[int]:
        return [int(state[off]) if n else 0 for off, n in self.atoms]

    def errors(self) -> list[str]:
        """Double counts at any step, and final buffers that differ from what the collective promises."""
        out = list(self.recording.problems)
        for i, (masks, ones) in enumerate(zip(self.states, self.counts)):
            when = "at the start" if i == 0 else "at the end" if i > len(self.steps) \
                else f"after {self.steps[i - 1][0]} {self.steps[i - 1][1]}"
            for r in range(self.p):
                pops = np.array([bin(int(m)).count("1") for m in masks[r]])
                bad = np.flatnonzero(pops != ones[r])
                if bad.size:
                    e = int(bad[0])
                    out.append(f"ERROR: rank {r} element {e} {when} holds {int(ones[r][e])} contributions "
                               f"but only {pops[e]} distinct ranks ({letters(int(masks[r][e]))}): "
                               "a contribution was counted twice")
        for r in range(self.p):
            bad = np.flatnonzero(self.states[-1][r] != self.expected[r])
            if bad.size:
                e = int(bad[0])
                out.append(f"ERROR: rank {r} element {e} ends with {letters(int(self.states[-1][r][e]))}, "
                           f"expected {letters(int(self.expected[r][e]))}")
        return out


def _load(collective: str, algorithm) -> Callable:
    """The function that runs ``collective`` on one rank: ``body(comm, buf, extra, segment_bytes)``."""
    if callable(algorithm):                     # your own allreduce, with the common signature
        return lambda comm, buf, extra, sb: algorithm(comm, buf, Op.SUM, workspace=Workspace(), segment_bytes=sb)
    if algorithm not in COLLECTIVES[collective]:
        raise ValueError(f"{collective} has no algorithm {algorithm!r}; choose one of: "
                         f"{', '.join(COLLECTIVES[collective])}")
    if collective == "allreduce":
        if algorithm == "mpi":
            raise Unavailable("'mpi' calls the MPI library's own MPI_Allreduce, whose messages are not "
                              "visible to Python; run it under mpirun instead")
        try:
            fn = _allreduce_function(algorithm)
        except ModuleNotFoundError as exc:
            raise Unavailable(f"algorithm {algorithm!r} is not available in this checkout ({exc})") from None
        return lambda comm, buf, extra, sb: fn(comm, buf, Op.SUM, workspace=Workspace(), segment_bytes=sb)
    module = importlib.import_module(f"..algorithms.{collective}", __package__)
    if collective == "broadcast":
        fn = module.binomial if algorithm == "binomial" else module.scatter_allgather
        return lambda comm, buf, extra, sb: fn(comm, buf, 0)
    if collective == "allgather":
        return lambda comm, buf, extra, sb: module.allgatherv(comm, extra[0], buf, extra[1])
    if collective == "alltoall":            # buf is the receive buffer; extra = (send buffer, counts)
        return lambda comm, buf, extra, sb: module.alltoallv(comm, extra[0], extra[1], buf, extra[2])
    return lambda comm, buf, extra, sb: module.reducescatter(comm, buf, extra[0], extra[1], Op.SUM,
                                                           workspace=Workspace())


def _inputs(collective: str, p: int, count: int, rank: int, value: Callable[[int], int]):
    """``(buf, extra, expected_final)`` for one rank; ``buf`` is the buffer the tables show."""
    full = sum(value(r) for r in range(p))
    sizes = partition.chunk_sizes(count, p)
    offsets = partition.chunk_offsets(count, p)
    if collective == "allreduce":
        return np.full(count, value(rank), np.int64), None, np.full(count, full, np.int64)
    if collective == "broadcast":
        return np.full(count, value(rank) if rank == 0 else 0, np.int64), None, np.full(count, value(0), np.int64)
    if collective == "allgather":
        buf = np.zeros(count, np.int64)
        block = np.full(sizes[rank], value(rank), np.int64)
        buf[offsets[rank]:offsets[rank] + sizes[rank]] = block   # my block is in place from the start
        expected = np.concatenate([np.full(n, value(r), np.int64) for r, n in enumerate(sizes)])
        return buf, (block, sizes), expected
    if collective == "alltoall":    # rank r sends sizes[r] elements to every rank: chunk j comes from j
        send = np.full(p * sizes[rank], value(rank), np.int64)
        expected = np.concatenate([np.full(n, value(r), np.int64) for r, n in enumerate(sizes)])
        return np.zeros(count, np.int64), (send, [sizes[rank]] * p, sizes), expected
    # reducescatter: the tables show buf (reduced in place); rank r's own segment ends complete.
    buf = np.full(count, value(rank), np.int64)
    out = np.empty(sizes[rank], np.int64)
    return buf, (out, sizes), None


def _record(collective: str, algorithm, p: int, count: int, segment_bytes: int,
            value: Callable[[int], int], node_size: int = 0) -> tuple[Recording, list[np.ndarray], list]:
    body = _load(collective, algorithm)
    rec = Recording(p)
    starts: list[np.ndarray] = [None] * p  # type: ignore[list-item]
    module = None
    if collective == "allreduce":
        fn = algorithm if callable(algorithm) else _allreduce_function(algorithm)
        module = sys.modules.get(fn.__module__)

    def rank_main(inner):
        buf, extra, expected = _inputs(collective, p, count, inner.rank, value)
        transport = RecordingTransport(inner, rec)
        if algorithm == REGISTERED:             # the buffer itself in shared memory: shm reads it in place
            seg = shared.allocate(transport, buf.nbytes)
            registered = seg.data(inner.rank, buf.dtype, buf.size)
            registered[:] = buf
            buf = registered
        rec.track(inner.rank, buf=buf)
        starts[inner.rank] = buf.copy()
        if node_size:                           # hierarchical: pretend nodes of node_size ranks
            transport.fake_node_size = node_size
        body(transport, buf, extra, segment_bytes)
        rec.finish(inner.rank)
        if collective == "reducescatter":     # the promise: my segment of buf, and out, are complete
            out, sizes = extra
            full = sum(value(r) for r in range(p))
            expected = buf.copy()
            off = partition.chunk_offsets(count, p)[inner.rank]
            expected[off:off + sizes[inner.rank]] = full
            if not np.array_equal(out, expected[off:off + sizes[inner.rank]]):
                rec.problems.append(f"ERROR: rank {inner.rank}: out is not the reduced segment {inner.rank}")
        return expected

    with patch_kernels(rec, *([module] if module else [])):
        expected = run_threads(p, rank_main, world=ThreadWorld(p, timeout=20.0), timeout=20.0)
    return rec, starts, expected


def _order(rec: Recording) -> list[tuple[str, int]]:
    """Merge every rank's sequence of marks into one order of steps (first appearance breaks ties)."""
    seqs = [[k for k, _ in log.marks] for log in rec.ranks]
    first: dict[tuple[str, int], tuple[int, int]] = {}
    for r, seq in enumerate(seqs):
        for i, k in enumerate(seq):
            first[k] = min(first.get(k, (i, r)), (i, r))
    before = {k: set() for k in first}
    for seq in seqs:
        for a, b in zip(seq, seq[1:]):
            before[b].add(a)
    order: list[tuple[str, int]] = []
    while len(order) < len(first):
        ready = [k for k in first if k not in order and before[k] <= set(order)]
        if not ready:                           # ranks disagree on the order: fall back to first use
            ready = [k for k in first if k not in order]
        order.append(min(ready, key=lambda k: first[k]))
    return order


def _states(rec: Recording, starts: list[np.ndarray], order: list) -> list[list[np.ndarray]]:
    index = {k: i for i, k in enumerate(order)}
    states = [[s.copy() for s in starts]]
    for i in range(len(order)):
        row = []
        for r, log in enumerate(rec.ranks):
            later = [snap for k, snap in log.marks if index[k] > i]
            row.append((later[0] if later else log.end)["buf"])
        states.append(row)
    return states


def _atoms(count: int, p: int, rec: Recording, states) -> tuple[list[tuple[int, int]], list[str]]:
    cuts = {0, count}
    for m in rec.messages:
        for loc in (m.src_loc, m.dst_loc):
            if loc and loc[0] == "buf":
                cuts.update((loc[1], loc[1] + loc[2]))
    for red in rec.reductions:
        if red.dst_loc and red.dst_loc[0] == "buf":
            cuts.update((red.dst_loc[1], red.dst_loc[1] + red.dst_loc[2]))
    for row in states:
        for s in row:
            cuts.update((np.flatnonzero(s[1:] != s[:-1]) + 1).tolist())
    edges = sorted(cuts)
    atoms = [(a, b - a) for a, b in zip(edges, edges[1:])]
    chunks = partition.chunks(count, p)
    inside = [[a for a in atoms if off <= a[0] < off + n] for off, n in chunks]
    if sum(len(x) for x in inside) == len(atoms) and all(
            not x or (x[0][0] == off and x[-1][0] + x[-1][1] == off + n) for x, (off, n) in zip(inside, chunks)):
        # The pieces refine partition.chunks: name them by chunk, and by segment within it (2.1).
        return atoms, [str(c) if len(x) == 1 else f"{c}.{k}" for c, x in enumerate(inside) for k in range(len(x))]
    return atoms, [str(i) for i in range(len(atoms))]


def explain(algorithm: str, p: int, count: int, *, collective: str = "allreduce",
            segment_bytes: int = 256 << 10, node_size: int = 0) -> Trace:
    """Run ``collective`` with ``algorithm`` on ``p`` thread ranks and return the cut-up trace.

    Args:
        algorithm: a name from ``COLLECTIVES[collective]``, or (for allreduce) your own function
            with the common signature ``fn(comm, buf, op, *, workspace, segment_bytes)``.
        p: number of ranks, 1..26.
        count: elements in the buffer (int64).
        collective: allreduce, broadcast, allgather, reducescatter or alltoall (rank r sends
            chunk r's size to every rank, so chunk j of every receive buffer comes from rank j).
        segment_bytes: pipeline segment passed to allreduce algorithms.
        node_size: for ``hierarchical``, pretend nodes of this many consecutive ranks (0: one node).

    Returns:
        The :class:`Trace`. Raises ``ValueError`` for bad arguments and
        :class:`Unavailable` for an algorithm that cannot run on threads.
    """
    if callable(algorithm) and collective != "allreduce":
        raise ValueError("only an allreduce can be given as a function")
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of: {', '.join(COLLECTIVES)}")
    if not 1 <= p <= MAX_RANKS:
        raise ValueError(f"ranks must be in 1..{MAX_RANKS} (one letter each), got {p}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rec, starts, expected = _record(collective, algorithm, p, count, segment_bytes, lambda r: 1 << r, node_size)
    ones, ones_starts, _ = _record(collective, algorithm, p, count, segment_bytes, lambda r: 1, node_size)
    order = _order(rec)
    if _order(ones) != order:
        raise RuntimeError(f"{algorithm} took different steps on different data; it cannot be explained")
    if not order and rec.messages:               # messages but no marks: one unnamed step
        order = [START]
    index = {k: i for i, k in enumerate(order)}
    step_messages: list[list[Message]] = [[] for _ in order]
    for m in rec.messages:                       # the later of sender's and receiver's step; 0 if unmarked
        step_messages[max(index.get(m.send_key, 0), index.get(m.recv_key, 0))].append(m)
    states = _states(rec, starts, order)
    counts = _states(ones, ones_starts, order)
    if not order:                                # nothing marked (p = 1, count = 0): start and end
        states.append([log.end["buf"] for log in rec.ranks])
        counts.append([log.end["buf"] for log in ones.ranks])
    atoms, labels = _atoms(count, p, rec, states)
    name = algorithm if isinstance(algorithm, str) else algorithm.__qualname__
    return Trace(collective, name, p, count, order, states, counts, step_messages, atoms, labels,
                 rec, expected, segment_bytes)


def model_terms(collective: str, algorithm: str, p: int, nbytes: int | None = None,
                segment_bytes: int = 256 << 10) -> tuple[float, float, float]:
    """``(a, b, g)`` of the alpha-beta-gamma model: ``select.terms`` for allreduce (at ``nbytes``: the
    same terms ``select.predict`` and ``auto`` use), else from the collective's module docstring."""
    from ..algorithms import select
    if p <= 1:
        return 0.0, 0.0, 0.0
    lg = math.ceil(math.log2(p))
    if collective == "allreduce":
        return select.terms(algorithm, p, nbytes, segment_bytes)
    if collective == "broadcast":
        return (lg, lg, 0.0) if algorithm == "binomial" else (lg + p - 1, 2 * (p - 1) / p, 0.0)
    if collective in ("allgather", "alltoall"):
        return p - 1, (p - 1) / p, 0.0
    return p - 1, (p - 1) / p, (p - 1) / p
