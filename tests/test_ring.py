"""Ring allreduce on the in-process transport: every p, edge counts, dtypes, ops, segmentations."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from allreduce.algorithms import ring
from allreduce.ops import SUPPORTED_DTYPES, Op

from .harness import assert_allreduce_ok, make_inputs, run_algorithm


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 3, 7, 100, 1001])
def test_edges_float32_sum(p, count):
    inputs = make_inputs(np.random.default_rng(count * 10 + p), p, count, np.float32, Op.SUM)
    assert_allreduce_ok(run_algorithm(ring.allreduce, inputs, Op.SUM, segment_bytes=64), inputs, Op.SUM)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_every_dtype_and_op(dtype, op):
    for p in (2, 3, 5):
        inputs = make_inputs(np.random.default_rng(p), p, 37, dtype, op)
        assert_allreduce_ok(run_algorithm(ring.allreduce, inputs, op, segment_bytes=16), inputs, op)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), count=st.integers(0, 3000), dtype=st.sampled_from(SUPPORTED_DTYPES),
       op=st.sampled_from(list(Op)), segment_bytes=st.sampled_from([8, 100, 4096, 1 << 20]))
def test_generated(p, count, dtype, op, segment_bytes):
    inputs = make_inputs(np.random.default_rng(count), p, count, dtype, op)
    assert_allreduce_ok(run_algorithm(ring.allreduce, inputs, op, segment_bytes=segment_bytes), inputs, op)


def test_plan_covers_every_chunk_once():
    segs, send, recv = ring.reduce_scatter_plan(10, 4, 4, 1, segment_bytes=8)
    assert [sum(n for _, n in chunk) for chunk in segs] == [3, 3, 2, 2]
    assert send[0] is segs[1] and recv[0] is segs[0]
