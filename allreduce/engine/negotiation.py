"""Agreeing, every cycle, which named tensors are ready on every rank (Horovod's response cache).

Every rank runs the same protocol on the same replicated state, so every
rank reaches the same decisions without a coordinator.

Fast path: a name that has been negotiated once owns a position in the
cache (the same position on every rank). Each cycle every rank allreduces
(Sum) one int64 vector::

    [pending, slow, shutdown, stall_cutoff,  mask(pos 0), mask(pos 1), ..., mask(pos n-1)]

where ``pending``/``slow``/``shutdown`` count the ranks with something
pending / something new to announce / a shutdown request, ``stall_cutoff``
is sent by rank 0 only (its stall inspector's decision, see stall.py), and
``mask(pos)`` has bit ``r`` set by rank ``r`` when its tensor for that cache
position is ready. Ranks set distinct bits, so the Sum is the bitwise OR:
a full mask means "ready everywhere", and a partial one says exactly which
ranks are missing. Cost: one allreduce of ``8 (4 + n)`` bytes (p <= 63).

Idle: when the last cycle saw nothing pending anywhere, only the 4 flags
are reduced (32 bytes); if one of them says "pending", the full vector
follows in the same cycle. ``idle`` counts consecutive such cycles; it is
the same on every rank, so the engine can slow its idle cycles down in
lockstep (engine.py).

Slow path (only when ``slow > 0``): new names are allgathered with their
metadata ``(shape, dtype, op, compression)`` and merged, in rank order, into
a message table that is thus identical on every rank. A name announced by
every rank is resolved: same metadata -> ready, and it gets a cache
position; different metadata -> ``MismatchError`` on every rank. A rank
that submits a cached name with new metadata announces it again, which
evicts it from the cache on every rank.

Execution order: ready cache positions in position order, then names
resolved this cycle in table order. Both are the same on every rank.

Join (Horovod's ``hvd.join()``, for uneven data). A rank that has run out of
batches announces a join record on the slow path (it raises ``pending`` and
``slow`` for that cycle), so every rank adds it to the replicated ``joined``
set in the same cycle. From then on a name counts as ready when every rank
not joined has submitted it; a joined rank that lacks it reduces zeros of the
agreed shape and dtype (``Outcome.zeros``), so ``Average`` divides the active
ranks' sum by the full size, as Horovod's does. The cycle in which the last
rank joins reports the highest rank among those that joined in it
(``Outcome.joined``) and empties the set: joins start over after that.
A name with a custom compressor cannot be zero-filled (its payload is the
compressor's): it fails on every rank while a rank that lacks it is joined.
"""
from __future__ import annotations

import heapq

import time
from typing import Callable

import numpy as np

from ..errors import MismatchError
from ..ops import Op
from .compression import BUILTIN_NAMES
from .handle import Entry, Meta
from .stall import out_of_step

__all__ = ["Negotiator", "Outcome", "describe_meta"]

_FLAGS = 4
_PENDING, _SLOW, _SHUTDOWN, _CUTOFF = range(_FLAGS)
_BITS = 63   # rank bits per int64 word: bits 0..62, so the Sum of distinct bits never overflows


class Outcome:
    """What one cycle decided; the same on every rank."""

    __slots__ = ("ready", "errors", "stalled", "shutdown", "ranks", "zeros", "joined", "out_of_step")

    def __init__(self):
        self.ready: list[str] = []                           # execute in this order
        self.errors: dict[str, Exception] = {}               # fail these names
        self.stalled: dict[str, tuple[list[int], list[int]]] = {}  # name -> (ready ranks, missing)
        self.shutdown = False
        self.ranks: dict[str, frozenset[int]] = {}           # who is ready, per name seen this cycle
        self.zeros: dict[str, Meta] = {}                     # ready names this (joined) rank reduces as zeros
        self.joined: int | None = None                       # every rank has joined: the last one to
        self.out_of_step: str | None = None                  # stalled because every rank waits: who for what


def describe_meta(field: int, value) -> str:
    if field == 2:
        return repr(Op(value))
    if field == 0 and value and isinstance(value[0], tuple):      # a group: one shape per array
        shown = ", ".join(map(str, value[:4])) + (", ..." if len(value) > 4 else "")
        return f"group of {len(value)} arrays [{shown}]"
    return str(value)


_FIELD_NAMES = ("shape", "dtype", "op", "compression")


def _mismatch(name: str, metas: dict[int, Meta]) -> MismatchError:
    ranks = sorted(metas)
    problems = []
    for i, field in enumerate(_FIELD_NAMES):
        values = [metas[r][i] for r in ranks]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {describe_meta(i, metas[r][i])}" for r in ranks)
            problems.append(f"{field} differs across ranks ({shown})")
    hooks = {str(metas[r][3]) for r in ranks}
    state = ("; a comm hook's state must be reset on every rank alike (hook.reset() on every rank, or a new "
             "hook object on every rank)") if len(hooks) > 1 and len({h.rsplit(", ", 1)[0] for h in hooks}) == 1 \
        else ""
    return MismatchError(f"allreduce of {name!r}: " + "; ".join(problems)
                         + ". Every rank must submit a name with the same shape, dtype, op and compression "
                         f"(comm hook, with the same settings){state}.")


class Negotiator:
    """The replicated cache and message table of one engine."""

    def __init__(self, rank: int, size: int, allreduce: Callable[[np.ndarray, Op], None],
                 allgather_object: Callable, *, capacity: int = 1024):
        self.rank, self.size = rank, size
        self._allreduce, self._allgather = allreduce, allgather_object
        self.capacity = capacity
        self.words = -(-size // _BITS)
        self.names: list[str | None] = []        # cache position -> name (None: free)
        self.free: list[int] = []                # freed positions, reused lowest first (heap)
        self.metas: list[Meta | None] = []
        self.positions: dict[str, int] = {}
        self.table: dict[str, dict[int, Meta]] = {}   # announced, uncached names -> rank -> meta
        # Names some ranks are ready for and others not: name -> (since cycle, since time, ready ranks).
        self.partial: dict[str, tuple[int, float, frozenset[int]]] = {}
        self.cycle = 0
        self.idle = 0                            # consecutive cycles with nothing pending anywhere
        self.tiny = True
        self.stats = {"tiny": 0, "full": 0, "slow": 0}   # exchanges of each kind (tests, benchmarks)
        self._vec = np.zeros(_FLAGS, np.int64)
        self._everyone = frozenset(range(size))
        self._full = np.zeros(self.words, np.int64)          # the mask of a name ready everywhere
        for r in range(size):
            self._full[r // _BITS] |= 1 << (r % _BITS)
        self.joining = False                     # this rank has a join to announce (set by the engine)
        self.joined: frozenset[int] = frozenset()     # ranks joined, the same on every rank
        self._joined_mask = np.zeros(self.words, np.int64)
        self._last_joined = -1

    # -- the cycle -------------------------------------------------------------------------
    def negotiate(self, pending: dict[str, Entry], *, shutdown: bool, cutoff: int) -> Outcome:
        """Run one cycle of the protocol over this rank's ``pending`` entries."""
        self.cycle += 1
        out = Outcome()
        joining = self.joining
        flags = [1 if pending or joining else 0, 0, 1 if shutdown else 0,
                 cutoff + 1 if self.rank == 0 and cutoff >= 0 else 0]
        # One pass over pending: cached names with the same metadata set their bit ("mine"); the
        # others are new to the cache and go through the slow path.
        metas, new, mine = self.metas, [], []
        position, ready_at = self.positions.get, mine.append     # bound once: a tensor's loop is ~0.1 us
        for e in pending.values():
            if not e.announced:
                pos = position(e.name)
                if pos is not None and metas[pos] == e.meta:
                    ready_at(pos)
                else:
                    new.append(e)
        flags[_SLOW] = 1 if new or joining else 0
        if self.tiny:
            vec = self._exchange(flags, None)
            self.stats["tiny"] += 1
            if vec[_PENDING] == 0:
                self.idle += 1
                out.shutdown = bool(vec[_SHUTDOWN])
                return out
        self.idle = 0
        vec = self._exchange(flags, mine)
        self.stats["full"] += 1
        self.tiny = vec[_PENDING] == 0
        out.shutdown = bool(vec[_SHUTDOWN])
        masks = vec[_FLAGS:].reshape(len(self.names), self.words)
        partial_now: dict[str, frozenset[int]] = {}
        names, ready, ranks, everyone, joined = self.names, out.ready, out.ranks, self._everyone, self.joined
        if joined:                                          # joined ranks count as ready
            full = ((masks | self._joined_mask) == self._full).all(axis=1).tolist()
            for pos in np.flatnonzero(masks.any(axis=1)).tolist():   # 1. cached names someone is ready for
                name = names[pos]
                if full[pos] and self._zero_fill(name, metas[pos], pos, masks[pos], out):
                    ready.append(name)
                    ranks[name] = everyone
                else:
                    partial_now[name] = ranks[name] = self._ranks(masks[pos])
        else:                                               # 1. the same, a whole vector at a time
            full = (masks == self._full).all(axis=1)        # ready on every rank
            ready += [names[pos] for pos in np.flatnonzero(full).tolist()]
            ranks.update(dict.fromkeys(ready, everyone))
            partial = np.flatnonzero(masks.any(axis=1) & ~full)
            seen: dict[tuple, frozenset[int]] = {}          # a mask's ranks, once per distinct mask
            for pos, row in zip(partial.tolist(), masks[partial].tolist()):
                key = tuple(row)
                who = seen.get(key)
                if who is None:
                    who = seen[key] = self._ranks(masks[pos])
                name = names[pos]
                partial_now[name] = ranks[name] = who
        if vec[_SLOW]:                                      # 2. new names
            self.stats["slow"] += 1
            records = [(e.name, e.meta) for e in new] + ([(None, ())] if joining else [])
            self.joining = False
            self._merge(self._allgather(records))
            for e in new:
                e.announced = True
        for name, metas in list(self.table.items()):
            ranks = frozenset(metas)
            out.ranks[name] = ranks
            if len(metas) + len(self.joined - ranks) < self.size:
                partial_now[name] = ranks
                continue
            del self.table[name]
            first = metas[min(metas)]
            if not all(m == first for m in metas.values()):
                out.errors[name] = _mismatch(name, metas)
            elif self._zero_fill(name, first, None, ranks, out):
                self._insert(name, first)
                out.ready.append(name)
        if len(self.joined) == self.size:                   # everyone has joined: report, start over
            out.joined = self._last_joined
            self._set_joined(frozenset())
        self._track_partial(partial_now, int(vec[_CUTOFF]) - 1, out)
        return out

    # -- pieces ------------------------------------------------------------------------------
    def _zero_fill(self, name: str, meta: Meta, pos: int | None, ready, out: Outcome) -> bool:
        """A name ready with joined ranks' help: record zeros for this rank if it lacks the name;
        False (and an error on every rank) where zeros cannot stand in (a custom compressor)."""
        if not self.joined:
            return True
        lacking = self.joined - (self._ranks(ready) if pos is not None else ready)
        if not lacking:
            return True
        if meta[3] not in BUILTIN_NAMES:
            out.errors[name] = MismatchError(
                f"allreduce of {name!r}: rank(s) {', '.join(map(str, sorted(lacking)))} joined without "
                f"it, and its custom compressor {meta[3]!r} cannot be zero-filled there; use a built-in "
                "compression or submit it on every rank")
            return False
        if self.rank in lacking:
            out.zeros[name] = meta
        return True

    def _set_joined(self, joined: frozenset[int]) -> None:
        self.joined = joined
        self._joined_mask[:] = 0
        for r in joined:
            self._joined_mask[r // _BITS] |= 1 << (r % _BITS)

    def _exchange(self, flags: list[int], mine: list[int] | None) -> np.ndarray:
        """Allreduce (Sum) the flags, and with ``mine`` (this rank's ready cache positions) the masks."""
        n = 0 if mine is None else len(self.names) * self.words
        if self._vec.size != _FLAGS + n:
            self._vec = np.zeros(_FLAGS + n, np.int64)
        vec = self._vec
        vec[:] = 0
        vec[:_FLAGS] = flags
        if mine:                                             # one numpy store, not one per tensor
            word, bit = divmod(self.rank, _BITS)
            vec[_FLAGS + word + self.words * np.array(mine, np.int64)] = 1 << bit
        self._allreduce(vec, Op.SUM)
        return vec

    def _ranks(self, words: np.ndarray) -> frozenset[int]:
        ranks = []
        for w, v in enumerate(words.tolist()):
            while v:                                        # one step per set bit
                low = v & -v
                ranks.append(w * _BITS + low.bit_length() - 1)
                v ^= low
        return frozenset(ranks)

    def _merge(self, announcements: list[list[tuple[str, Meta]]]) -> None:
        joined = set(self.joined)
        for rank, records in enumerate(announcements):     # rank order: the same table everywhere
            for name, meta in records:
                if name is None:                             # a join record
                    joined.add(rank)
                    self._last_joined = rank
                    continue
                pos = self.positions.pop(name, None)
                if pos is not None:                          # cached name with new metadata: evict
                    self.names[pos] = self.metas[pos] = None
                    heapq.heappush(self.free, pos)
                self.table.setdefault(name, {})[rank] = tuple(meta)
        if len(joined) != len(self.joined):
            self._set_joined(frozenset(joined))

    def _insert(self, name: str, meta: Meta) -> None:
        if name in self.positions:
            return
        if self.free:                                       # reuse the lowest free position: O(log n)
            pos = heapq.heappop(self.free)
        else:
            if len(self.names) >= self.capacity:
                return                                      # cache full: this name stays on the slow path
            pos = len(self.names)
            self.names.append(None)
            self.metas.append(None)
        self.names[pos], self.metas[pos] = name, meta
        self.positions[name] = pos

    def _track_partial(self, partial_now: dict[str, frozenset[int]], cutoff: int, out: Outcome) -> None:
        """Remember since when each name is partial; apply rank 0's stall cutoff."""
        old, fresh = self.partial, (self.cycle, time.monotonic())
        partial = {}
        for name, ranks in partial_now.items():
            since = old.get(name, fresh)
            partial[name] = (since[0], since[1], ranks)
        self.partial = partial
        if cutoff < 0:
            return
        out.out_of_step = out_of_step(self.partial, self.size)      # the same text on every rank
        everyone = set(range(self.size))
        for name, (since, _, ranks) in list(self.partial.items()):
            if since <= cutoff:
                out.stalled[name] = (sorted(ranks), sorted(everyone - ranks))
                self.table.pop(name, None)
                del self.partial[name]
