"""Double binary tree allreduce on the in-process transport: the trees, every p, edges, dtypes, ops, segments."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from allreduce import algorithms
from allreduce.algorithms import tree
from allreduce.buffers import Workspace
from allreduce.ops import SUPPORTED_DTYPES, Op, bfloat16
from allreduce.transport.base import Transport
from allreduce.transport.threads import run_threads

from .harness import assert_allreduce_ok, make_inputs, run_algorithm


# --- the trees ---------------------------------------------------------------------------------

def _reachable(t: tree.Tree) -> set[int]:
    seen, todo = set(), [t.root]
    while todo:
        r = todo.pop()
        assert r not in seen, f"rank {r} reached twice: not a tree"
        seen.add(r)
        todo.extend(t.children[r])
    return seen


@pytest.mark.parametrize("p", range(1, 65))
def test_trees_span_all_ranks_and_share_no_interior_rank(p):
    trees = tree.double_binary_tree(p)
    for t in trees:
        assert len(t.parent) == len(t.children) == p
        assert [r for r in range(p) if t.parent[r] < 0] == [t.root]
        for r in range(p):
            assert len(t.children[r]) <= 2, f"p={p}: rank {r} has {len(t.children[r])} children"
            assert all(t.parent[c] == r for c in t.children[r]), f"p={p}: parent/children disagree at {r}"
        assert _reachable(t) == set(range(p)), f"p={p}: tree does not span every rank"
        even = p - p % 2                             # the docstring's depth: ceil(log2 p), p - 1 if p is odd
        assert t.depth() == (math.ceil(math.log2(even)) if p > 1 else 0), f"p={p}: depth {t.depth()}"
    assert not trees[0].interior() & trees[1].interior(), f"p={p}: a rank is interior in both trees"


def test_p8_matches_the_docstring_diagram():
    t0, t1 = tree.double_binary_tree(8)
    assert (t0.root, t1.root) == (0, 7)
    assert t0.children == ((4,), (), (1, 3), (), (2, 6), (), (5, 7), ())
    assert t1.children == ((), (0, 2), (), (1, 5), (), (4, 6), (), (3,))
    assert t0.interior() == {0, 2, 4, 6} and t1.interior() == {1, 3, 5, 7}
    assert t0.depth() == t1.depth() == 3


def test_odd_p_hangs_the_last_rank_under_both_roots():
    t0, t1 = tree.double_binary_tree(7)
    assert t0.parent[6] == t0.root and t1.parent[6] == t1.root
    assert 6 not in t0.interior() | t1.interior()


def test_p_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        tree.double_binary_tree(0)


# --- the allreduce -----------------------------------------------------------------------------

def test_registered_under_its_name():
    assert algorithms.get("tree") is tree.allreduce


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 100, 1001])
def test_edges_float32_sum(p, count):
    inputs = make_inputs(np.random.default_rng(count * 10 + p), p, count, np.float32, Op.SUM)
    assert_allreduce_ok(run_algorithm(tree.allreduce, inputs, Op.SUM, segment_bytes=64), inputs, Op.SUM)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
@pytest.mark.parametrize("segment_bytes", [1, 4, 12, 100, 4096, 1 << 20])
def test_segment_sizes(p, segment_bytes):
    # 1 and 4 bytes: one float32 per message, the deepest pipeline; 1 << 20: one segment per half.
    inputs = make_inputs(np.random.default_rng(p), p, 203, np.float32, Op.AVERAGE)
    assert_allreduce_ok(run_algorithm(tree.allreduce, inputs, Op.AVERAGE, segment_bytes=segment_bytes),
                        inputs, Op.AVERAGE)


def test_large_ish():
    inputs = make_inputs(np.random.default_rng(0), 6, 300_001, np.float32, Op.SUM)
    assert_allreduce_ok(run_algorithm(tree.allreduce, inputs, Op.SUM, segment_bytes=64 << 10), inputs, Op.SUM)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_every_dtype_and_op(dtype, op):
    for p in (2, 3, 5, 8):
        inputs = make_inputs(np.random.default_rng(p), p, 37, dtype, op)
        assert_allreduce_ok(run_algorithm(tree.allreduce, inputs, op, segment_bytes=16), inputs, op)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64], ids=str)
@pytest.mark.parametrize("op", [Op.SUM, Op.MIN, Op.MAX], ids=repr)
def test_bitwise_identical_with_signed_zeros_and_nan_payloads(dtype, op):
    # min(-0.0, +0.0) and NaN + NaN depend on operand order; ranks must still agree bit for bit.
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    nan = np.array(np.nan, dtype).view(bits)
    for p in (2, 3, 6, 8):
        inputs = []
        for r in range(p):
            x = np.array([0.0 if r % 2 else -0.0] * 4 + [np.nan] * 4, dtype)
            x[4:] = (nan | bits(r + 1)).view(dtype)          # a different NaN payload per rank
            inputs.append(x)
        results = run_algorithm(tree.allreduce, inputs, op, segment_bytes=4)
        assert all(r.tobytes() == results[0].tobytes() for r in results), f"p={p}: ranks differ"
        assert np.all(results[0][:4] == 0) and np.all(np.isnan(results[0][4:]))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 8), count=st.integers(0, 3000), dtype=st.sampled_from(SUPPORTED_DTYPES),
       op=st.sampled_from(list(Op)), segment_bytes=st.sampled_from([64, 500, 4096, 1 << 20]))
def test_generated(p, count, dtype, op, segment_bytes):
    inputs = make_inputs(np.random.default_rng(count), p, count, dtype, op)
    assert_allreduce_ok(run_algorithm(tree.allreduce, inputs, op, segment_bytes=segment_bytes), inputs, op)


class _Counting(Transport):
    """Wraps a transport; counts the bytes this rank sends and records the marked steps."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.sent, self.marks = inner, inner.rank, inner.size, 0, []

    def isend(self, buf, dest, tag=0):
        self.sent += buf.nbytes
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        return self.inner.irecv(buf, source, tag)

    def barrier(self):
        self.inner.barrier()

    def mark(self, phase, step):
        self.marks.append((phase, step))


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8])
def test_every_rank_sends_at_most_2n_and_the_steps_are_marked(p):
    n = 4000   # float32 elements: each half is 8000 bytes, 4 segments of 2000 bytes

    def body(t):
        comm = _Counting(t)
        tree.allreduce(comm, np.ones(n, np.float32), Op.SUM, workspace=Workspace(), segment_bytes=2000)
        return comm.sent, comm.marks
    sent, marks = zip(*run_threads(p, body, timeout=20))
    assert max(sent) <= 2 * 4 * n, f"some rank sent more than 2n bytes: {sent}"
    assert sum(sent) == 2 * (p - 1) * 4 * n     # each tree: every edge carries its half up and down
    assert marks[0] == [("reduce", k) for k in range(4)] + [("broadcast", k) for k in range(4)]


# Under MPI, np = 1..5: tests/test_api_mpi.py::test_api_tree_rd_and_collectives_against_mpi runs
# tests/mpi/tree_rd_check.py (tree and rd) in the same job as the API and collectives matrices.
