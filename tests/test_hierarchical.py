"""Hierarchical allreduce: fake nodes on thread ranks (even and uneven), layouts, stress, MPI incl. TCP."""
import functools

import numpy as np
import pytest

from allreduce.algorithms import hierarchical
from allreduce.ops import SUPPORTED_DTYPES, Op
from allreduce.transport.threads import run_threads

from .harness import assert_allreduce_ok, make_inputs, mpirun, run_algorithm
from .test_shm import stress


def hier(node_size, slot_bytes=16):
    return functools.partial(hierarchical.allreduce, node_size=node_size, slot_bytes=slot_bytes)


@pytest.mark.parametrize("p,node_size", [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (5, 2), (6, 3),
                                         (6, 2), (7, 3), (8, 4), (4, 0)])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 100, 1001])
def test_edges_float32_sum(p, node_size, count):
    inputs = make_inputs(np.random.default_rng(count * 10 + p), p, count, np.float32, Op.SUM)
    got = run_algorithm(hier(node_size), inputs, Op.SUM, segment_bytes=32)
    assert_allreduce_ok(got, inputs, Op.SUM)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_every_dtype_and_op(dtype, op):
    for p in (3, 4):                           # 3 = nodes {0,1},{2} (uneven); 4 = {0,1},{2,3}
        inputs = make_inputs(np.random.default_rng(p), p, 37, dtype, op)
        assert_allreduce_ok(run_algorithm(hier(2, 24), inputs, op, segment_bytes=16), inputs, op)


def test_layouts():
    def describe(comm):
        plan = hierarchical.layout(comm, 2)
        cross = plan.cross.members if plan.cross else None
        return plan.nodes, plan.even, plan.node.members, cross
    even = run_threads(4, describe)
    assert even[0] == (2, True, (0, 1), (0, 2)) and even[3] == (2, True, (2, 3), (1, 3))
    uneven = run_threads(5, describe)            # nodes {0,1} {2,3} {4}: leaders 0, 2, 4 talk
    assert uneven[0] == (3, False, (0, 1), (0, 2, 4))
    assert uneven[1] == (3, False, (0, 1), None) and uneven[4] == (3, False, (4,), (0, 2, 4))


@pytest.mark.parametrize("p", [3, 4])
def test_stress_back_to_back_threads(p):
    stress(p, 600, hier(2, 64), seed=p)


@pytest.mark.parametrize("np_,env", [(3, {}), (4, {}), (4, {"OMPI_MCA_btl": "tcp,self"})],
                         ids=["np3-uneven", "np4", "np4-tcp"])
def test_mpi_stress_fake_nodes(np_, env):
    out = mpirun(np_, "shm_stress.py", "hierarchical", "600", "1024", "2", timeout=240, env=env)
    assert out.stdout.count("hierarchical allreduces OK") == np_


def test_mpi_public_api_fake_nodes():
    out = mpirun(4, "api_check.py", "hierarchical", timeout=240, env={"ALLREDUCE_FAKE_NODE_SIZE": "2"})
    assert out.returncode == 0
