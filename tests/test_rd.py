"""Recursive doubling allreduce on the in-process transport: every p, edge counts, dtypes, ops, bitwise identity.

Under mpirun, rd is checked together with tree by tests/test_tree.py (tests/mpi/tree_rd_check.py).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from allreduce import algorithms
from allreduce.algorithms import rd
from allreduce.buffers import Workspace
from allreduce.ops import SUPPORTED_DTYPES, Op, bfloat16
from allreduce.transport.base import Transport
from allreduce.transport.threads import run_threads

from .harness import assert_allreduce_ok, make_inputs, run_algorithm


def test_registered_under_its_name():
    assert algorithms.get("rd") is rd.allreduce


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 100, 1001, 20000])
def test_edges_float32_sum(p, count):
    inputs = make_inputs(np.random.default_rng(count * 10 + p), p, count, np.float32, Op.SUM)
    assert_allreduce_ok(run_algorithm(rd.allreduce, inputs, Op.SUM), inputs, Op.SUM)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_every_dtype_and_op(dtype, op):
    for p in (2, 3, 4, 5, 8):
        inputs = make_inputs(np.random.default_rng(p), p, 37, dtype, op)
        assert_allreduce_ok(run_algorithm(rd.allreduce, inputs, op), inputs, op)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64], ids=str)
@pytest.mark.parametrize("op", [Op.SUM, Op.AVERAGE, Op.MIN, Op.MAX], ids=repr)
def test_bitwise_identical_with_signed_zeros_and_nan_payloads(dtype, op):
    # Both partners of an exchange compute the pair. min(-0.0, +0.0) keeps the first operand and
    # NaN + NaN keeps the first payload, so relying on commutativity would make ranks disagree.
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    nan = np.array(np.nan, dtype).view(bits)
    for p in (2, 3, 4, 6, 8):
        inputs = []
        for r in range(p):
            x = np.array([0.0 if r % 2 else -0.0, -0.0 if r % 2 else 0.0] * 2 + [np.nan] * 4, dtype)
            x[4:] = (nan | bits(r + 1)).view(dtype)          # a different NaN payload per rank
            inputs.append(x)
        results = run_algorithm(rd.allreduce, inputs, op)
        assert all(r.tobytes() == results[0].tobytes() for r in results), f"p={p}: ranks differ"
        assert np.all(results[0][:4] == 0) and np.all(np.isnan(results[0][4:]))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32], ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_bitwise_identical_low_precision(dtype, op):
    for p in (2, 5, 8):
        inputs = make_inputs(np.random.default_rng(p + 100), p, 513, dtype, op)
        results = run_algorithm(rd.allreduce, inputs, op)
        assert_allreduce_ok(results, inputs, op)              # checks bitwise identity first


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), count=st.integers(0, 3000), dtype=st.sampled_from(SUPPORTED_DTYPES),
       op=st.sampled_from(list(Op)))
def test_generated(p, count, dtype, op):
    inputs = make_inputs(np.random.default_rng(count), p, count, dtype, op)
    assert_allreduce_ok(run_algorithm(rd.allreduce, inputs, op), inputs, op)


def test_core_layout_folds_the_first_2rem_ranks():
    # p = 6: q = 4, rem = 2; ranks 1 and 3 sit out, 0 2 4 5 become core ranks 0 1 2 3.
    assert [rd.core_layout(6, r) for r in range(6)] == \
        [(4, 2, 0), (4, 2, -1), (4, 2, 1), (4, 2, -1), (4, 2, 2), (4, 2, 3)]
    assert [rd.core_layout(8, r)[2] for r in range(8)] == list(range(8))


@pytest.mark.parametrize("p", range(1, 17))
def test_exchange_partners_agree(p):
    peers = [rd.exchange_peers(p, r) for r in range(p)]
    q = 1 << (p.bit_length() - 1)
    core = [r for r in range(p) if peers[r] or q == 1]
    assert len(core) == q
    for r in core:
        assert len(peers[r]) == q.bit_length() - 1
        for k, peer in enumerate(peers[r]):
            assert peers[peer][k] == r, f"p={p} step {k}: {r} -> {peer} but {peer} -> {peers[peer][k]}"


class _Counting(Transport):
    """Wraps a transport; counts the messages this rank sends and records the marked steps."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.sent, self.marks = inner, inner.rank, inner.size, 0, []

    def isend(self, buf, dest, tag=0):
        self.sent += 1
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        return self.inner.irecv(buf, source, tag)

    def barrier(self):
        self.inner.barrier()

    def mark(self, phase, step):
        self.marks.append((phase, step))


@pytest.mark.parametrize("p, expected", [(2, [1, 1]), (4, [2] * 4), (6, [3, 1, 3, 1, 2, 2]), (8, [3] * 8)])
def test_message_count_is_log2_q_plus_fold(p, expected):
    def body(t):
        comm = _Counting(t)
        rd.allreduce(comm, np.ones(100, np.float32), Op.SUM, workspace=Workspace())
        return comm.sent, comm.marks
    sent, marks = zip(*run_threads(p, body, timeout=20))
    assert list(sent) == expected
    steps = p.bit_length() - 1
    fold = [("fold", 0)] if p & (p - 1) else []
    unfold = [("unfold", 0)] if fold else []
    assert marks[0] == fold + [("exchange", k) for k in range(steps)] + unfold
