"""Registered buffers (``Communicator.shared_empty``): shm reduces them where they lie, no copy-in.

Thread ranks for the exhaustive cases, MPI ranks (under a timeout) for the real shared window.
Every result is compared bit for bit with shm's copy-in path on the same inputs, which adds in
the same order, and with the float64 reference.
"""
import functools

import numpy as np
import pytest

from allreduce.algorithms import shm
from allreduce.buffers import Workspace
from allreduce.comm import Communicator
from allreduce.config import Config
from allreduce.errors import MismatchError
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import SUPPORTED_DTYPES, Op
from allreduce.transport import shared
from allreduce.transport.threads import run_threads

from .harness import assert_allreduce_ok, make_inputs, mpirun, run_algorithm


def shm_with(slot_bytes):
    return functools.partial(shm.allreduce, slot_bytes=slot_bytes)


def registered_run(inputs, op, *, check=False, pad=0, slot_bytes=None):
    """Each thread rank copies its input into a registered array (at element ``pad``) and reduces it
    in place with algorithm shm; returns (results, whether shm found the buffer registered)."""
    def body(comm):
        c = Communicator(comm, config=Config(check=check, algorithm="shm"))
        x = inputs[comm.rank]
        whole = c.shared_empty(pad + x.size, x.dtype)
        buf = whole[pad:]
        buf[:] = x.reshape(-1)
        found = shared.find(comm, buf) is not None
        if slot_bytes is None:
            c.allreduce_(buf, op)
        else:
            shm.allreduce(comm, buf, op, workspace=Workspace(), slot_bytes=slot_bytes)
        return buf.reshape(x.shape).copy(), found
    got = run_threads(len(inputs), body, timeout=20)
    return [g for g, _ in got], [f for _, f in got]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 100, 1001])
@pytest.mark.parametrize("slot_bytes", [None, 8, 100], ids=["one-window", "8B", "100B"])
def test_edges_match_the_copy_in_path_bit_for_bit(p, count, slot_bytes):
    """Windows of 8 bytes per rank: a 1001-element buffer streams through hundreds of windows. A
    window holds ``slot_bytes`` per rank here, and ``slot_bytes`` in all on the copy-in path (each
    region holds a whole window): the same cut with p times the copy-in path's window."""
    inputs = make_inputs(np.random.default_rng(count * 10 + p), p, count, np.float32, Op.SUM)
    got, found = registered_run(inputs, Op.SUM, slot_bytes=slot_bytes)
    assert all(found)
    assert_allreduce_ok(got, inputs, Op.SUM)
    cut = None if slot_bytes is None else shm_with(p * slot_bytes)
    copy_in = run_algorithm(cut or shm.allreduce, inputs, Op.SUM)
    assert [g.tobytes() for g in got] == [c.tobytes() for c in copy_in]


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_every_dtype_and_op(dtype, op):
    for p in (2, 3):
        inputs = make_inputs(np.random.default_rng(p), p, 37, dtype, op)
        got, _ = registered_run(inputs, op, pad=3, slot_bytes=16)   # a slice inside the array, 16 B windows
        assert_allreduce_ok(got, inputs, op)
        copy_in = run_algorithm(shm_with(p * 16), inputs, op)
        assert [g.tobytes() for g in got] == [c.tobytes() for c in copy_in]


def test_one_rank_is_a_copy_of_the_input():
    inputs = [np.arange(5, dtype=np.float64)]
    got, _ = registered_run(inputs, Op.AVERAGE)
    assert np.array_equal(got[0], inputs[0])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_stress_back_to_back_slices_of_one_buffer(p):
    """1000 calls, no barrier, each on a random slice of one registered array (the same slice on
    every rank), new inputs written the moment the last call returns: a rank that returned while
    a peer still read its slice would corrupt the peer's result, and exact integers catch it."""
    rng = np.random.default_rng(p)
    plan = []
    for i in range(1000):
        count = int(rng.integers(0, 50)) if i % 8 else int(rng.integers(0, 2000))
        start = int(rng.integers(0, 64))
        op = [Op.SUM, Op.MAX, Op.MIN, Op.AVERAGE][i % 4]
        xs = [rng.integers(-3, 4, count).astype(np.int32) for _ in range(p)]
        plan.append((start, xs, op, allreduce_reference(xs, op)))

    def body(comm):
        whole = Communicator(comm, config=Config(check=False)).shared_empty(2100, np.int32)
        for i, (start, xs, op, want) in enumerate(plan):
            buf = whole[start:start + xs[0].size]
            buf[:] = xs[comm.rank]
            shm.allreduce(comm, buf, op, workspace=Workspace(), slot_bytes=16 + 4 * (i % 5))
            if buf.tobytes() != want.tobytes():
                raise AssertionError(f"rank {comm.rank} call {i}: {buf[:8]} want {want[:8]}")
    run_threads(p, body, timeout=60)


def test_ranks_passing_different_slices_all_raise():
    """Without the metadata check: rank 1 passes another slice; every rank raises, naming both."""
    errors = {}

    def body(comm):
        whole = Communicator(comm, config=Config(check=False)).shared_empty(100, np.float32)
        start = 10 if comm.rank == 1 else 0
        with pytest.raises(MismatchError) as info:
            shm.allreduce(comm, whole[start:start + 50], Op.SUM, workspace=Workspace())
        errors[comm.rank] = str(info.value)
    run_threads(3, body, timeout=20)
    assert sorted(errors) == [0, 1, 2]
    assert "rank 1" in errors[0] and "element 10" in errors[0] and "differ across ranks" in errors[0]
    assert "element 0" in errors[1]


def test_registered_on_one_rank_only_is_a_mismatch_error_with_the_check():
    errors = {}

    def body(comm):
        c = Communicator(comm, config=Config(check=True, algorithm="shm"))
        mine = c.shared_empty(16, np.float32)
        x = mine if comm.rank == 0 else np.zeros(16, np.float32)
        with pytest.raises(MismatchError) as info:
            c.allreduce_(x, Op.SUM)
        errors[comm.rank] = str(info.value)
    run_threads(2, body, timeout=20)
    assert errors[0] == errors[1]
    assert "shared differs across ranks" in errors[0] and "a private array" in errors[0]


def test_shared_empty_checks_its_arguments_on_every_rank():
    def body(comm):
        c = Communicator(comm, config=Config(check=True))
        with pytest.raises(MismatchError, match="count differs"):
            c.shared_empty(4 + comm.rank, np.float32)
        with pytest.raises(ValueError, match="negative dimension"):
            c.shared_empty((2, -1))
        a, b = c.shared_empty((3, 4), np.float64), c.shared_empty(7, np.int8)
        return a.shape, a.dtype, b.shape, shared.find(comm, a.reshape(-1)) is not None
    got = run_threads(2, body, timeout=20)
    assert got == [((3, 4), np.float64, (7,), True)] * 2


def test_other_algorithms_and_out_of_place_calls_treat_it_as_memory():
    """ring on a registered array, or allreduce() (a new result) from one, give the same answer."""
    inputs = make_inputs(np.random.default_rng(5), 3, 333, np.float64, Op.SUM)

    def body(comm):
        c = Communicator(comm, config=Config(check=True))
        buf = c.shared_empty(333, np.float64)
        buf[:] = inputs[comm.rank]
        out = c.allreduce(buf, Op.SUM, algorithm="shm")           # reads buf, leaves it alone
        assert np.array_equal(buf, inputs[comm.rank])
        c.allreduce_(buf, Op.SUM, algorithm="ring")
        return out, buf.copy()
    got = run_threads(3, body, timeout=20)
    assert_allreduce_ok([o for o, _ in got], inputs, Op.SUM)
    assert_allreduce_ok([r for _, r in got], inputs, Op.SUM)


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_mpi_registered_stress_and_errors(np_):
    out = mpirun(np_, "shm_registered.py", "600", timeout=240)
    assert out.stdout.count("registered allreduces OK") == np_, out.stdout + out.stderr
    assert out.stdout.count("mismatch raised") == np_
