"""alltoall(v): the pairwise-exchange algorithm and ``Communicator.alltoall`` on thread ranks.

Every result is compared with a numpy transpose of the ranks' blocks. The
MPI side (and tfops) is checked in tests/mpi/tf_collectives.py.
"""
import numpy as np
import pytest

from allreduce.algorithms import alltoall as a2a
from allreduce.comm import Communicator
from allreduce.errors import InvalidArgumentError, MismatchError
from allreduce.explain.symbolic import explain
from allreduce.ops import SUPPORTED_DTYPES
from allreduce.transport.threads import run_threads

TIMEOUT = 20


def _splits(rng, p, count):
    """Random non-negative splits of ``count`` rows over p ranks, zeros likely."""
    cuts = np.sort(rng.integers(0, count + 1, p - 1))
    return np.diff(np.concatenate([[0], cuts, [count]])).astype(np.int64)


def _reference(inputs, splits):
    """What rank r must receive: block r of every rank's input, in rank order."""
    p = len(inputs)
    offsets = [np.concatenate([[0], np.cumsum(s)]) for s in splits]
    return [np.concatenate([inputs[j][offsets[j][r]:offsets[j][r + 1]] for j in range(p)])
            for r in range(p)]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("count", [0, 4, 100, 1000])
def test_alltoallv_algorithm_against_transpose(p, count):
    rng = np.random.default_rng(p * 10007 + count)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(p)]
    splits = [_splits(rng, p, count) for _ in range(p)]
    want = _reference(inputs, splits)

    def body(t):
        recv_counts = [int(splits[j][t.rank]) for j in range(p)]
        out = np.full(sum(recv_counts), np.nan, np.float32)
        a2a.alltoallv(t, inputs[t.rank], splits[t.rank].tolist(), out, recv_counts)
        return out
    for r, got in enumerate(run_threads(p, body, timeout=TIMEOUT)):
        assert got.tobytes() == want[r].tobytes(), f"p={p} count={count} rank {r}"


@pytest.mark.parametrize("p", [1, 3, 4])
def test_alltoall_equal_blocks(p):
    block = 5
    inputs = [np.arange(p * block, dtype=np.int64) + 1000 * r for r in range(p)]

    def body(t):
        out = np.empty(p * block, np.int64)
        a2a.alltoall(t, inputs[t.rank], out)
        return out
    want = _reference(inputs, [[block] * p] * p)
    assert all(np.array_equal(g, w) for g, w in zip(run_threads(p, body, timeout=TIMEOUT), want))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("rows", [0, 1, 7, 12])
def test_communicator_alltoall_rows_and_received_splits(p, rows):
    rng = np.random.default_rng(rows + 31 * p)
    inputs = [rng.integers(-50, 50, (rows, 2, 3)).astype(np.int32) for _ in range(p)]
    splits = [_splits(rng, p, rows) for _ in range(p)]
    want = _reference(inputs, splits)
    results = run_threads(p, lambda t: Communicator(t).alltoall(inputs[t.rank], splits[t.rank].tolist()),
                          timeout=TIMEOUT)
    for r, (got, rsplits) in enumerate(results):
        assert got.shape == (sum(int(s[r]) for s in splits), 2, 3) and got.dtype == np.int32
        assert np.array_equal(got, want[r])
        assert rsplits.tolist() == [int(s[r]) for s in splits]


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_communicator_alltoall_every_dtype_equal_split(dtype):
    p = 3
    inputs = [(np.arange(6) + 10 * r).astype(dtype) for r in range(p)]
    results = run_threads(p, lambda t: Communicator(t).alltoall(inputs[t.rank]), timeout=TIMEOUT)
    want = _reference(inputs, [[2, 2, 2]] * p)
    for r, (got, rsplits) in enumerate(results):
        assert got.dtype == np.dtype(dtype) and got.tobytes() == want[r].tobytes()
        assert rsplits.tolist() == [2, 2, 2]


def _errors_on_every_rank(p, call):
    """Run ``call(comm)`` on p ranks; return each rank's (exception type, message)."""
    def body(t):
        try:
            call(Communicator(t))
        except (InvalidArgumentError, MismatchError) as exc:
            return type(exc), str(exc)
        return None, "no error"
    return run_threads(p, body, timeout=TIMEOUT)


@pytest.mark.parametrize("bad, needle", [
    ([1, 1], "splits has 2 entries; it needs one per rank (3)"),
    ([4, -1, 0], "splits[1] is negative"),
    ([1, 1, 0], "splits sums to 2, not to the tensor's first dimension (3)"),
    ([[1, 1, 1]], "1-D sequence of integers"),
    ([1.0, 1.0, 1.0], "1-D sequence of integers"),
])
def test_bad_splits_raise_on_every_rank_naming_the_rank(bad, needle):
    def call(c):
        c.alltoall(np.zeros((3, 2), np.float32), bad if c.rank == 1 else [1, 1, 1])
    for kind, message in _errors_on_every_rank(3, call):
        assert kind is InvalidArgumentError and "alltoall on rank 1" in message and needle in message, message


def test_indivisible_without_splits_scalar_and_mismatches_raise_everywhere():
    p = 2
    out = _errors_on_every_rank(p, lambda c: c.alltoall(np.zeros(3 if c.rank else 2)))
    assert all(k is InvalidArgumentError and "rank 1" in m and "divisible" in m for k, m in out), out
    out = _errors_on_every_rank(p, lambda c: c.alltoall(np.float32(c.rank)))
    assert all(k is InvalidArgumentError and "rank 0" in m and "no dimensions" in m for k, m in out), out
    out = _errors_on_every_rank(p, lambda c: c.alltoall(np.zeros((2, 3 + c.rank))))
    assert all(k is MismatchError and "elements per row" in m for k, m in out), out
    out = _errors_on_every_rank(p, lambda c: c.alltoall(np.zeros(2, np.float32 if c.rank else np.float64)))
    assert all(k is MismatchError and "dtype" in m for k, m in out), out
    out = _errors_on_every_rank(p, lambda c: c.alltoall(np.zeros(2, np.complex64 if c.rank else np.float32)))
    assert all(k is InvalidArgumentError and "rank 1" in m and "dtype" in m for k, m in out), out


@pytest.mark.parametrize("p, count", [(1, 3), (3, 6), (4, 7), (4, 2)])
def test_explain_alltoall_steps_and_final_transpose(p, count):
    trace = explain("pairwise", p, count, collective="alltoall")
    assert trace.errors() == []
    assert trace.steps == [("alltoall", k) for k in range(p)]
    for k, messages in enumerate(trace.step_messages):
        assert all((m.dst - m.src) % p == k for m in messages), k
