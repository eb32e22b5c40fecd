"""The double binary tree of NCCL 2.4: two binary trees over the same p ranks, no rank interior in both.

:mod:`.tree` reduces up and broadcasts down these two trees, each over half
of the buffer; this module builds them, and says what one rank does in
each (:class:`Role`) and how the two ends of the top edge finish (:func:`finish_top`). Tree 0 is the in-order binary
tree on rank numbers (NCCL's ncclGetBtree): a rank's level is its lowest set
bit, so odd ranks are leaves, and rank 0 is a root with one child. Tree 1 is
its mirror r -> m - 1 - r, which swaps odd and even ranks (both are drawn
for p = 8 in :mod:`.tree`).

Mirroring swaps parity only for an even count, so for odd p both trees are
built on the first p - 1 ranks and the last rank hangs under each root as a
leaf (each root has one child, so there is room). Depth: ceil(log2 p) edges
for even p, ceil(log2 (p - 1)) for odd p.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from .. import kernels
from ..errors import InvalidArgumentError
from ..ops import Op

__all__ = ["Tree", "double_binary_tree", "Role", "role_of", "finish_top"]

TAG = 20     # tree t reduces on TAG + 2t and broadcasts on TAG + 2t + 1
UP, DOWN = TAG + 4, TAG + 5   # the one-segment path's two phases (see tree_small.one_segment)
SWAP = TAG + 6                # tree t's top edge swaps on SWAP + t, in every path


@dataclasses.dataclass(frozen=True)
class Tree:
    """A rooted tree over ranks ``0..p-1``.

    Attributes:
        root: the rank with no parent.
        parent: ``parent[r]`` is rank r's parent, -1 for the root.
        children: ``children[r]`` is the sorted tuple of rank r's children (at most 2).
    """

    root: int
    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    def interior(self) -> frozenset[int]:
        """The ranks that have children (they receive and reduce)."""
        return frozenset(r for r, kids in enumerate(self.children) if kids)

    def depth(self) -> int:
        """Edges on the longest path from the root down to a leaf."""
        def height(r: int) -> int:
            return 1 + max(map(height, self.children[r])) if self.children[r] else 0
        return height(self.root)


def _tree(parent: list[int]) -> Tree:
    children: list[list[int]] = [[] for _ in parent]
    for r, up in enumerate(parent):
        if up >= 0:
            children[up].append(r)
    return Tree(parent.index(-1), tuple(parent), tuple(tuple(sorted(c)) for c in children))


def _inorder_parents(m: int) -> list[int]:
    """Parents in the in-order binary tree on ``m`` ranks (NCCL's ncclGetBtree), root 0.

    A rank r with lowest set bit b sits at level b: its children are r - b/2
    and r + b/2 (or the nearest existing rank right of r), its parent is
    whichever of r + b and r - b has bit 2b set; if that is off the end,
    r - b. Rank 0 is a root whose one child is the highest power of two < m.
    """
    parent = [-1] * m
    for r in range(1, m):
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        parent[r] = up if up < m else r ^ bit
    return parent


@lru_cache(maxsize=64)
def double_binary_tree(p: int) -> tuple[Tree, Tree]:
    """Two binary trees spanning ``p`` ranks, no rank interior in both.

    Tree 0 is the in-order tree (even ranks interior, odd ranks leaves).
    Tree 1 is its mirror image r -> m-1-r, which turns odd ranks interior
    and even ranks into leaves. Mirroring swaps parity only for even m, so
    for odd p both are built on m = p - 1 ranks and rank p - 1 becomes a leaf
    hanging from each root (each root has only one child, so there is room).

    Args:
        p: number of ranks, at least 1.

    Returns:
        ``(tree0, tree1)``. For p = 1 both are the single rank 0.
    """
    if p < 1:
        raise InvalidArgumentError(f"double_binary_tree: p must be at least 1, got {p}")
    if p == 1:
        single = Tree(0, (-1,), ((),))
        return single, single
    m = p if p % 2 == 0 else p - 1
    first = _inorder_parents(m)
    mirror = [-1 if first[m - 1 - r] < 0 else m - 1 - first[m - 1 - r] for r in range(m)]
    if m < p:                          # odd p: the last rank is a leaf under both roots
        first.append(0)
        mirror.append(m - 1)
    return _tree(first), _tree(mirror)


class Role(NamedTuple):
    """This rank's part in one tree: whom it talks to and which segments of its half it moves.

    ``children`` hand partial sums up and get finished segments back; for the root they leave
    out its partner. ``up`` gets this rank's partial sum and ``parent`` sends the finished
    segments (both -1 at the top). ``partner`` is the other end of the top edge (-1 if this
    rank is not at the top), and ``first`` says this rank is the root, whose partial is the
    left operand of the final reduction."""
    parent: int
    up: int
    children: tuple[int, ...]
    partner: int
    first: bool
    segs: tuple[tuple[int, int], ...]
    up_tag: int
    down_tag: int
    swap_tag: int


def role_of(tree: Tree, rank: int, t: int, segs: tuple[tuple[int, int], ...], up_tag: int, down_tag: int) -> Role:
    root = tree.root
    partner = tree.children[root][0]            # the root's first child: the deepest subtree
    swap = SWAP + t
    if rank == root:
        return Role(-1, -1, tree.children[rank][1:], partner, True, segs, up_tag, down_tag, swap)
    if rank == partner:
        return Role(-1, -1, tree.children[rank], root, False, segs, up_tag, down_tag, swap)
    parent = tree.parent[rank]
    return Role(parent, parent, tree.children[rank], -1, False, segs, up_tag, down_tag, swap)


def finish_top(mine: np.ndarray, theirs: np.ndarray, op: Op, p: int, first: bool) -> None:
    """The top edge's final reduction into ``mine``: ``root (op) partner`` on both ends.

    The root computes ``mine (op) theirs``; the partner ``theirs (op) mine``, with ``theirs``
    (the root's partial) first, so Min and Max pick the same zero or NaN on both ends."""
    if first:
        kernels.reduce_finish_into(mine, theirs, op, p)
    elif not kernels.reduce_finish_into_both(theirs, mine, mine, op, p):
        kernels.reduce_finish_into(theirs, mine, op, p)          # 16-bit formats: two passes
        kernels.copy_into(mine, theirs)
