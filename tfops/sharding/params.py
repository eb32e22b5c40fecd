"""Stage 3's parameters: how each weight is cut over the ranks, and whether it is here right now.

Every trainable weight is cut into p pieces, flat, in rank order, whose sizes differ by at most
one element; the one-larger pieces continue round the ranks from weight to weight, so every rank
holds ``floor(N/p)`` or ``ceil(N/p)`` of the model's N elements (of each dtype) and nothing is
padded. A *unit* (one layer that ``fully_shard`` wraps) gathers and reduce-scatters its weights
together: its block on rank r is rank r's pieces of the unit's weights, laid end to end::

    weights of a unit     |------- kernel (10) -------|-- bias (3) --|          p = 3
    pieces                | r0 4  | r1 3  | r2 3  |   |r0 |r1 1|r2 1|   (the larger bias piece
                                                       1                 goes on from r1: r0)
    block of r0 = kernel[0:4] bias[0:1]  r1 = kernel[4:7] bias[1:2]  r2 = kernel[7:10] bias[2:3]
    allgather of the blocks (counts 5, 4, 4) -> [r0 block | r1 block | r2 block] -> unpacked
    into each whole weight; the reduce-scatter packs the whole gradients the same way.

PyTorch FSDP2 cuts each parameter along dim 0 (``Shard(0)``, padded); we cut it flat and
unpadded, as the stage 1 and 2 layout does (:mod:`.layout`). The status of a unit's weights is
explicit, as DeepSpeed's ``ZeroParamStatus``: ``NOT_AVAILABLE`` (only this rank's pieces),
``IN_FLIGHT`` (its allgather is running), ``AVAILABLE`` (whole, while the layer computes).
Pack and unpack are one copy of the unit's bytes each, as a list of slice copies (``Group.moves``:
one per rank and piece) worked out once per layout (a block of examples/gpt.py, 16 weights at
p = 4, one process: 99 -> 32 us a pack, 158 -> 99 us an unpack against recomputing the offsets on
every call). Everything here is pure numpy.
"""
from __future__ import annotations

import dataclasses
import enum
import functools

import numpy as np

from allreduce.buffers import aligned_empty

from .layout import _split

__all__ = ["Status", "Piece", "Group", "UnitLayout", "cut", "pack", "unpack"]


class Status(enum.Enum):
    """Where a unit's whole weights are (DeepSpeed's ``ZeroParamStatus``)."""
    NOT_AVAILABLE = "not available"      # only this rank's pieces exist
    IN_FLIGHT = "in flight"              # the allgather is running (or queued: a prefetch)
    AVAILABLE = "available"              # whole, for the layer's forward or backward


@dataclasses.dataclass(frozen=True)
class Piece:
    """How one weight (``shape``, flat) is cut: rank r holds ``[starts[r], starts[r] + counts[r])``."""
    shape: tuple[int, ...]
    counts: tuple[int, ...]

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        return tuple(sum(self.counts[:r]) for r in range(len(self.counts)))


@dataclasses.dataclass(frozen=True)
class Group:
    """One dtype's weights of a unit: ``pieces`` in the unit's order, gathered as one block per rank."""
    dtype: str
    pieces: tuple[Piece, ...]

    def block(self, r: int) -> int:
        """Elements of rank ``r``'s block (its pieces of every weight)."""
        return sum(p.counts[r] for p in self.pieces)

    @functools.cached_property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self.block(r) for r in range(len(self.pieces[0].counts)))

    @functools.cached_property
    def moves(self) -> tuple[tuple[int, int, int, int], ...]:
        """The copies between the rank-major blocks and the whole weights, worked out once:
        ``(k, start in weight k, start in the blocks, count)``, rank by rank, empty pieces left out."""
        out, at = [], 0
        for r in range(len(self.blocks)):
            for k, p in enumerate(self.pieces):
                if p.counts[r]:
                    out.append((k, p.starts[r], at, p.counts[r]))
                at += p.counts[r]
        return tuple(out)

    def inner(self, r: int) -> tuple[int, ...]:
        """Where each weight's piece starts inside rank ``r``'s block."""
        return tuple(sum(p.counts[r] for p in self.pieces[:i]) for i in range(len(self.pieces)))


def cut(shapes: list[tuple[int, ...]], size: int, turn: int = 0) -> tuple[list[Piece], int]:
    """The pieces of weights of ``shapes`` over ``size`` ranks, the one-larger pieces starting at
    rank ``turn``; returns them and the next weight's ``turn``."""
    out = []
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        out.append(Piece(shape=tuple(int(d) for d in shape), counts=_split(n, size, turn)))
        turn = (turn + n) % size
    return out, turn


def pack(group: Group, fulls: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """The whole arrays ``fulls`` (one per piece of ``group``) laid out rank-major, block by
    block: the input of the reduce-scatter (and the inverse of :func:`unpack`)."""
    out = np.empty(sum(group.blocks), group.dtype) if out is None else out
    flat = [a.reshape(-1) for a in fulls]
    for k, s, at, c in group.moves:
        out[at:at + c] = flat[k][s:s + c]
    return out


def unpack(group: Group, gathered: np.ndarray) -> list[np.ndarray]:
    """The whole weights of ``group`` out of its allgathered blocks (rank-major); each result is
    aligned, so TensorFlow takes it without a copy."""
    outs = [aligned_empty(int(np.prod(p.shape, dtype=np.int64)), group.dtype) for p in group.pieces]
    for k, s, at, c in group.moves:
        outs[k][s:s + c] = gathered[at:at + c]
    return [o.reshape(p.shape) for p, o in zip(group.pieces, outs)]


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """A unit's weights by dtype: ``groups[g]`` cuts the weights ``members[g]`` (indices into the
    unit's weight list)."""
    groups: tuple[Group, ...]
    members: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(shapes: list[tuple[int, ...]], dtypes: list[str], size: int, turn: int) -> tuple["UnitLayout", int]:
        """The layout of a unit's weights (``shapes``, ``dtypes``), and the next unit's ``turn``."""
        pieces, turn = cut(shapes, size, turn)
        order = list(dict.fromkeys(dtypes))
        members = tuple(tuple(i for i, d in enumerate(dtypes) if d == dt) for dt in order)
        groups = tuple(Group(dtype=dt, pieces=tuple(pieces[i] for i in m)) for dt, m in zip(order, members))
        return UnitLayout(groups=groups, members=members), turn

    def piece(self, i: int) -> Piece:
        """The cut of the unit's weight ``i``."""
        g = next(k for k, m in enumerate(self.members) if i in m)
        return self.groups[g].pieces[self.members[g].index(i)]
