"""Broadcast, allgather(v), reducescatter: the algorithms directly and through ``Communicator``.

Threads stand in for ranks; every result is compared with a numpy reference.
The MPI test at the end compares against mpi4py's own collectives.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from allreduce import partition
from allreduce.algorithms import allgather, broadcast, reducescatter
from allreduce.buffers import Workspace
from allreduce.comm import Communicator
from allreduce.errors import InvalidArgumentError, MismatchError
from allreduce.ops import SUPPORTED_DTYPES, Op
from allreduce.transport.base import Transport
from allreduce.transport.threads import run_threads

from .harness import assert_allreduce_ok, make_inputs

TIMEOUT = 20


def _on_comms(p, fn):
    """Run ``fn(Communicator)`` on p thread ranks."""
    return run_threads(p, lambda t: fn(Communicator(t)), timeout=TIMEOUT)


class _Counting(Transport):
    """Wraps a transport; counts the messages this rank starts and records the phases it marks."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.messages, self.phases = inner, inner.rank, inner.size, 0, set()

    def mark(self, phase, step):
        self.phases.add(phase)

    def isend(self, buf, dest, tag=0):
        self.messages += 1
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self.messages += 1
        return self.inner.irecv(buf, source, tag)

    def barrier(self):
        self.inner.barrier()


# -- broadcast ---------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", [broadcast.binomial, broadcast.scatter_allgather], ids=lambda f: f.__name__)
@pytest.mark.parametrize("p", range(1, 8))
@pytest.mark.parametrize("count", [0, 1, 3, 6, 1001])
def test_broadcast_algorithms_from_every_root(algo, p, count):
    data = np.random.default_rng(count).standard_normal(count).astype(np.float32)
    for root in range(p):
        def body(t):
            buf = data.copy() if t.rank == root else np.full(count, np.nan, np.float32)
            algo(t, buf, root)
            return buf
        for rank, got in enumerate(run_threads(p, body, timeout=TIMEOUT)):
            assert got.tobytes() == data.tobytes(), f"root {root}, rank {rank}"


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_broadcast_picks_by_size_and_handles_count_0(p):
    for count, large in [(0, 1), (10, 1 << 20), (10, 8), (4000, 8)]:
        data = np.arange(count, dtype=np.int64)
        def body(t):
            counting = _Counting(t)
            buf = data.copy() if t.rank == p - 1 else np.zeros(count, np.int64)
            broadcast.broadcast(counting, buf, p - 1, large_bytes=large)
            return buf, counting.phases
        results = run_threads(p, body, timeout=TIMEOUT)
        assert all(np.array_equal(got, data) for got, _ in results)
        phases = set().union(*(phases for _, phases in results))
        if count == 0 or p == 1:
            assert phases == set()                      # nothing to do, nothing sent
        elif count * 8 >= large and p >= 3:
            assert phases == {"scatter", "allgather"}
        else:
            assert phases == {"broadcast"}


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_communicator_broadcast_every_root_and_dtype(dtype):
    p = 4
    data = make_inputs(np.random.default_rng(1), 1, 12, dtype, Op.SUM)[0].reshape(3, 4)
    for root in range(p):
        def body(comm):
            x = data if comm.rank == root else np.zeros_like(data)
            return comm.broadcast(x, root_rank=root)
        for got in _on_comms(p, body):
            assert got.dtype == data.dtype and got.shape == (3, 4) and got.tobytes() == data.tobytes()


def test_communicator_broadcast_large_goes_through_scatter_allgather():
    data = np.random.default_rng(2).standard_normal(broadcast.LARGE_BYTES // 4 + 123).astype(np.float32)
    results = _on_comms(5, lambda comm: comm.broadcast(data if comm.rank == 2 else np.zeros_like(data), 2))
    assert all(got.tobytes() == data.tobytes() for got in results)


@pytest.mark.parametrize("p", [1, 3, 4])
def test_broadcast_object_from_every_root(p):
    for root in range(p):
        obj = {"root": root, "list": list(range(root * 50)), "text": "x" * root}
        results = _on_comms(p, lambda comm: comm.broadcast_object(obj if comm.rank == root else None, root))
        assert results == [obj] * p


# -- allgather ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", range(1, 7))
def test_allgatherv_uneven_and_zero_counts(p):
    for counts in ([r % 3 for r in range(p)], [0] * p, [5 * r + 1 for r in range(p)]):
        blocks = [np.full(n, r, np.int32) for r, n in enumerate(counts)]
        def body(t):
            out = np.full(sum(counts), -1, np.int32)
            allgather.allgatherv(t, blocks[t.rank], out, counts)
            return out
        for got in run_threads(p, body, timeout=TIMEOUT):
            assert np.array_equal(got, np.concatenate(blocks))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_allgather_equal_blocks_still_works(p):
    def body(t):
        out = np.empty(3 * p, np.int64)
        allgather.allgather(t, np.full(3, t.rank, np.int64), out)
        return out
    assert all(np.array_equal(got, np.repeat(np.arange(p), 3)) for got in run_threads(p, body, timeout=TIMEOUT))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("p", [1, 2, 4, 5])
def test_communicator_allgather_different_first_dims(dtype, p):
    rows = [(2 * r) % 3 for r in range(p)]          # includes ranks with 0 rows
    inputs = [make_inputs(np.random.default_rng(r), 1, n * 6, dtype, Op.SUM)[0].reshape(n, 2, 3)
              for r, n in enumerate(rows)]
    want = np.concatenate(inputs)
    for got in _on_comms(p, lambda comm: comm.allgather(inputs[comm.rank])):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def test_communicator_allgather_scalars_and_vectors():
    assert _on_comms(3, lambda comm: comm.allgather(np.float64(comm.rank)).tolist()) == [[0.0, 1.0, 2.0]] * 3
    got = _on_comms(3, lambda comm: comm.allgather(np.arange(comm.rank, dtype=np.int8)))
    assert all(g.tolist() == [0, 0, 1] for g in got)


@pytest.mark.parametrize("p", [1, 2, 5])
def test_allgather_object(p):
    objs = [None if r == 1 else {"rank": r, "payload": "y" * (100 * r)} for r in range(p)]
    assert _on_comms(p, lambda comm: comm.allgather_object(objs[comm.rank])) == [objs] * p


# -- reducescatter -----------------------------------------------------------------------------
def _check_reducescatter(results, inputs, counts, op):
    offsets = np.cumsum([0] + counts)
    for r, got in enumerate(results):
        segment = [x.reshape(-1)[offsets[r]:offsets[r + 1]] for x in inputs]
        assert_allreduce_ok([got.reshape(-1)], segment, op)


@pytest.mark.parametrize("op", list(Op), ids=repr)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_communicator_reducescatter_every_op(op, dtype):
    if dtype.kind == "b" and op == Op.AVERAGE:           # refused on every rank, before any message
        errors = _on_comms(3, lambda comm: _raised(lambda: comm.reducescatter(np.ones((3, 3), bool), op)))
        assert all(isinstance(e, TypeError) and "Average of bool" in str(e) for e in errors), errors
        return
    for p, rows in [(1, 3), (3, 7), (4, 2), (5, 10)]:          # rows < p leaves some ranks empty
        inputs = [x.reshape(rows, 3) for x in make_inputs(np.random.default_rng(p), p, rows * 3, dtype, op)]
        results = _on_comms(p, lambda comm: comm.reducescatter(inputs[comm.rank], op))
        counts = [n * 3 for n in partition.chunk_sizes(rows, p)]
        assert [g.shape for g in results] == [(n // 3, 3) for n in counts]
        _check_reducescatter(results, inputs, counts, op)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), data=st.data(), dtype=st.sampled_from(SUPPORTED_DTYPES), op=st.sampled_from(list(Op)))
def test_reducescatter_generated_counts(p, data, dtype, op):
    counts = data.draw(st.lists(st.integers(0, 300), min_size=p, max_size=p))
    inputs = make_inputs(np.random.default_rng(sum(counts)), p, sum(counts), dtype, op)
    def body(t):
        out = np.empty(counts[t.rank], dtype)
        reducescatter.reducescatter(t, inputs[t.rank].copy(), out, counts, op, workspace=Workspace())
        return out
    _check_reducescatter(run_threads(p, body, timeout=TIMEOUT), inputs, counts, op)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), data=st.data(), dtype=st.sampled_from(SUPPORTED_DTYPES), op=st.sampled_from(list(Op)))
def test_reducescatter_keep_input_same_bits_input_untouched(p, data, dtype, op):
    """keep_input (the sharded optimizer reads TF's gradients in place): the overwriting version's
    bits, and ``buf`` unchanged."""
    counts = data.draw(st.lists(st.integers(0, 300), min_size=p, max_size=p))
    inputs = make_inputs(np.random.default_rng(sum(counts) + 1), p, sum(counts), dtype, op)
    def body(t, keep):
        buf = inputs[t.rank].copy()
        buf.setflags(write=not keep)                       # a write into a kept input raises
        out = np.empty(counts[t.rank], dtype)
        reducescatter.reducescatter(t, buf, out, counts, op, workspace=Workspace(), keep_input=keep)
        return out, buf
    kept = run_threads(p, lambda t: body(t, True), timeout=TIMEOUT)
    plain = run_threads(p, lambda t: body(t, False), timeout=TIMEOUT)
    for r in range(p):
        assert kept[r][0].tobytes() == plain[r][0].tobytes()
        assert kept[r][1].tobytes() == inputs[r].tobytes()
    _check_reducescatter([k[0] for k in kept], inputs, counts, op)


def test_reducescatter_keep_input_many_messages():
    """Segments of several 256 KiB messages: the two slots alternate message by message correctly."""
    p, n = 3, 3 * 200_000 + 1
    counts = partition.chunk_sizes(n, p)
    inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(p)]
    def body(t):
        out = np.empty(counts[t.rank], np.float32)
        buf = inputs[t.rank].copy()
        buf.setflags(write=False)
        reducescatter.reducescatter(t, buf, out, counts, Op.SUM, workspace=Workspace(), keep_input=True)
        return out
    got = np.concatenate(run_threads(p, body, timeout=TIMEOUT))
    np.testing.assert_allclose(got, np.sum(inputs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


# -- errors ------------------------------------------------------------------------------------
def _raised(fn):
    try:
        fn()
    except Exception as exc:            # noqa: BLE001 - the test inspects it
        return exc
    return None



@pytest.mark.parametrize("root", [-1, 3, 99, True, 1.0, "0", None])
def test_bad_root_raises_before_communicating(root):
    def body(t):
        counting = _Counting(t)
        comm = Communicator(counting)
        raised = []
        for call in (lambda: comm.broadcast(np.ones(4), root_rank=root),
                     lambda: comm.broadcast_object("x", root_rank=root)):
            with pytest.raises(InvalidArgumentError, match=r"root_rank must be an integer in \[0, 3\)"):
                call()
            raised.append(counting.messages)
        return raised
    assert run_threads(3, body, timeout=TIMEOUT) == [[0, 0]] * 3


def _errors_on_every_rank(p, call):
    """Run ``call(comm)`` on p ranks; return each rank's MismatchError text (fail if any rank didn't raise)."""
    def body(comm):
        try:
            call(comm)
        except MismatchError as exc:
            return str(exc)
        return None
    messages = _on_comms(p, body)
    assert all(m is not None for m in messages), f"not every rank raised: {messages}"
    return messages


def test_broadcast_count_mismatch_names_every_rank():
    messages = _errors_on_every_rank(3, lambda comm: comm.broadcast(np.zeros(comm.rank + 2)))
    for m in messages:
        assert "broadcast: count differs across ranks (rank 0: 2, rank 1: 3, rank 2: 4)" in m


def test_broadcast_dtype_mismatch_names_every_rank():
    dtypes = [np.float32, np.float32, np.int64]
    messages = _errors_on_every_rank(3, lambda comm: comm.broadcast(np.zeros(4, dtypes[comm.rank])))
    for m in messages:
        assert "dtype differs across ranks (rank 0: float32, rank 1: float32, rank 2: int64)" in m


def test_reducescatter_count_mismatch_names_every_rank():
    messages = _errors_on_every_rank(4, lambda comm: comm.reducescatter(np.ones((4, comm.rank % 2 + 1)), Op.SUM))
    for m in messages:
        assert "reducescatter: count differs across ranks (rank 0: 4, rank 1: 8, rank 2: 4, rank 3: 8)" in m


def test_reducescatter_op_mismatch_names_every_rank():
    ops = [Op.SUM, Op.MAX]
    messages = _errors_on_every_rank(2, lambda comm: comm.reducescatter(np.ones(4), ops[comm.rank]))
    for m in messages:
        assert "op differs across ranks (rank 0: ar.Sum, rank 1: ar.Max)" in m


def test_allgather_row_shape_mismatch_names_every_rank():
    messages = _errors_on_every_rank(3, lambda comm: comm.allgather(np.zeros((2, comm.rank + 1))))
    for m in messages:
        assert "allgather: elements per row (shape[1:]) differs across ranks (rank 0: 1, rank 1: 2, rank 2: 3)" in m


def test_broadcast_object_root_mismatch_names_every_rank():
    messages = _errors_on_every_rank(3, lambda comm: comm.broadcast_object("x", root_rank=min(comm.rank, 1)))
    for m in messages:
        assert "root_rank differs across ranks (rank 0: 0, rank 1: 1, rank 2: 1)" in m


# -- MPI -------------------------------------------------------------------------------------
# np = 1..5 under MPI: tests/test_api_mpi.py::test_api_tree_rd_and_collectives_against_mpi runs
# tests/mpi/collectives_check.py in one job with the API and tree/rd matrices.
