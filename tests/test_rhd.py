"""Recursive halving-doubling allreduce on the in-process transport: every p, edge counts, dtypes, ops."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from allreduce import partition
from allreduce.algorithms import rhd
from allreduce.ops import SUPPORTED_DTYPES, Op
from allreduce.buffers import Workspace
from allreduce.comm import Communicator
from allreduce.transport.base import Transport
from allreduce.transport.threads import run_threads

from .harness import assert_allreduce_ok, make_inputs, run_algorithm


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 3, 7, 100, 1001, 20000])
def test_edges_float32_sum(p, count):
    inputs = make_inputs(np.random.default_rng(count * 10 + p), p, count, np.float32, Op.SUM)
    assert_allreduce_ok(run_algorithm(rhd.allreduce, inputs, Op.SUM), inputs, Op.SUM)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_every_dtype_and_op(dtype, op):
    for p in (2, 3, 4, 6):
        inputs = make_inputs(np.random.default_rng(p), p, 37, dtype, op)
        assert_allreduce_ok(run_algorithm(rhd.allreduce, inputs, op), inputs, op)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), count=st.integers(0, 3000), dtype=st.sampled_from(SUPPORTED_DTYPES),
       op=st.sampled_from(list(Op)))
def test_generated(p, count, dtype, op):
    inputs = make_inputs(np.random.default_rng(count), p, count, dtype, op)
    assert_allreduce_ok(run_algorithm(rhd.allreduce, inputs, op), inputs, op)


def test_core_layout_folds_the_first_2rem_ranks():
    # p = 6: q = 4, rem = 2; ranks 1 and 3 sit out, 0 2 4 5 become core ranks 0 1 2 3.
    assert [rhd.core_layout(6, r) for r in range(6)] == \
        [(4, 2, 0), (4, 2, -1), (4, 2, 1), (4, 2, -1), (4, 2, 2), (4, 2, 3)]
    assert [rhd.core_layout(8, r)[2] for r in range(8)] == list(range(8))


@pytest.mark.parametrize("q", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 3, 10, 1001])
def test_halving_plan_partners_agree_and_final_blocks_tile_the_buffer(q, count):
    plans = [rhd.halving_plan(count, q, r) for r in range(q)]
    for r, plan in enumerate(plans):
        assert len(plan) == q.bit_length() - 1
        for step, (peer, keep, give) in enumerate(plan):
            peer_peer, peer_keep, peer_give = plans[peer][step]
            assert peer_peer == r and peer_keep == give and peer_give == keep  # sizes match both ways
    # After the last halving step core rank r keeps exactly block r of partition.chunks.
    assert [plan[-1][1] for plan in plans] == list(partition.chunks(count, q))


class _Counting(Transport):
    """Wraps a transport and counts the messages this rank sends."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.sent = inner, inner.rank, inner.size, 0

    def isend(self, buf, dest, tag=0):
        self.sent += 1
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        return self.inner.irecv(buf, source, tag)

    def barrier(self):
        self.inner.barrier()


@pytest.mark.parametrize("p, expected", [(4, [4, 4, 4, 4]), (6, [5, 1, 5, 1, 4, 4]), (8, [6] * 8)])
def test_message_count_is_2_log2_q_plus_fold(p, expected):
    def body(t):
        comm = _Counting(t)
        rhd.allreduce(comm, np.ones(1000, np.float32), Op.SUM, workspace=Workspace())
        return comm.sent
    assert run_threads(p, body, timeout=20) == expected


@pytest.mark.parametrize("p", [3, 4])
def test_through_communicator(p):
    inputs = make_inputs(np.random.default_rng(p), p, 2 * 3 * 5, np.float64, Op.AVERAGE)
    inputs = [x.reshape(2, 3, 5) for x in inputs]
    results = run_threads(p, lambda t: Communicator(t).allreduce(inputs[t.rank], Op.AVERAGE, algorithm="rhd"),
                          timeout=20)
    assert_allreduce_ok(results, inputs, Op.AVERAGE)
