"""ZeRO stage 3 (issue 44): the cut of the weights here, fully_shard + ShardedOptimizer(stage=3) under mpirun.

The rank script tests/mpi/stage3_check.py (its docstring lists the checks) runs once per world
size, 3 and 4, the second loading the checkpoint the first wrote (another rank count), in
tests/test_tf_parallel_scripts.py's launches; -np 2 is in tests/mpi/recompute_check.py.
"""
import numpy as np
import pytest

pytest.importorskip("tensorflow")
from tfops.sharding.params import Group, UnitLayout, cut, pack, unpack  # noqa: E402

@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_cut_balances_every_rank_and_pack_inverts_unpack(size):
    shapes = [(7, 5), (5,), (5, 3), (3,), (1,), (0,)]
    pieces, _ = cut(shapes, size)
    per_rank = [sum(p.counts[r] for p in pieces) for r in range(size)]
    n = sum(int(np.prod(s)) for s in shapes)
    assert sum(per_rank) == n and max(per_rank) - min(per_rank) <= 1      # floor or ceil of N/p, no padding
    for p, s in zip(pieces, shapes):
        assert sum(p.counts) == int(np.prod(s)) and max(p.counts) - min(p.counts) <= 1
    group = Group(dtype="float32", pieces=tuple(pieces))
    rng = np.random.default_rng(size)
    fulls = [rng.standard_normal(s).astype("f4") for s in shapes]
    packed = pack(group, fulls)
    at = 0
    for r in range(size):                                  # rank-major: rank r's pieces, weight by weight
        for p, f in zip(pieces, fulls):
            np.testing.assert_array_equal(packed[at:at + p.counts[r]], f.ravel()[p.starts[r]:p.starts[r] + p.counts[r]])
            at += p.counts[r]
    for a, b in zip(unpack(group, packed), fulls):
        np.testing.assert_array_equal(a, b)


def test_unit_layout_groups_by_dtype_and_continues_the_turn():
    layout, turn = UnitLayout.of([(3,), (2,), (5,)], ["float32", "float16", "float32"], 2, 1)
    assert layout.members == ((0, 2), (1,)) and [g.dtype for g in layout.groups] == ["float32", "float16"]
    assert layout.piece(0).counts == (1, 2) and layout.piece(1).counts == (1, 1) and layout.piece(2).counts == (3, 2)
    assert turn == (1 + 10) % 2
