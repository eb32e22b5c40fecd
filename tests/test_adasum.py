"""Adasum (allreduce/algorithms/adasum.py) on thread ranks, against a numpy float64 reference.

The reference is the same binary tree over contiguous halves of the ranks, each pair combined as
``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b`` on whole vectors; the algorithm computes it by vector
halving, so its dot products are summed in another order: close, not bitwise, to the reference,
and bitwise identical across ranks.
"""
import numpy as np
import pytest

from allreduce.algorithms import adasum
from allreduce.buffers import Workspace
from allreduce.comm import Communicator
from allreduce.errors import InvalidArgumentError, MismatchError
from allreduce.ops import Op, bfloat16
from allreduce.transport.threads import run_threads

TIMEOUT = 20
TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-6, np.dtype(np.float16): 4e-3,
             np.dtype(bfloat16): 3e-2}


def _run(inputs):
    """Adasum of ``inputs[r]`` on rank r (the algorithm, thread ranks); the results, per rank."""
    def body(t):
        buf = inputs[t.rank].copy()
        adasum.allreduce(t, buf, Op.ADASUM, workspace=Workspace())
        return buf
    return run_threads(len(inputs), body, timeout=TIMEOUT)


def _check(inputs, dtype):
    results = _run([x.astype(dtype) for x in inputs])
    for r in results[1:]:                              # bitwise identical on every rank
        assert r.tobytes() == results[0].tobytes()
    ref = adasum.reference([x.astype(dtype) for x in inputs])
    scale = max(np.abs(ref).max(initial=0.0), 1e-30)
    np.testing.assert_allclose(results[0].astype(np.float64), ref, rtol=0,
                               atol=TOLERANCE[np.dtype(dtype)] * scale * 4)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 100, 1001])
def test_matches_reference(p, count):
    rng = np.random.default_rng(p * 1000 + count)
    inputs = [rng.standard_normal(count) + 0.3 * r for r in range(p)]   # correlated: not all orthogonal
    for dtype in (np.float64, np.float32):
        _check(inputs, dtype)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_half_precision(dtype):
    rng = np.random.default_rng(7)
    _check([rng.standard_normal(257) for _ in range(4)], dtype)


def test_orthogonal_gradients_add_and_equal_ones_average():
    p, n = 4, 16
    basis = np.eye(n)
    orthogonal = [basis[r] * (r + 1) for r in range(p)]            # pairwise orthogonal
    assert np.array_equal(_run(orthogonal)[0], np.sum(orthogonal, axis=0))
    same = [np.linspace(-1, 1, n)] * p
    np.testing.assert_allclose(_run(same)[0], same[0], rtol=1e-15)
    # a zero gradient leaves the other unchanged (Horovod's zero-norm guard), on either side
    g = np.linspace(1, 2, n)
    for pair in ([g, np.zeros(n)], [np.zeros(n), g]):
        assert np.array_equal(_run(pair)[0], g)
    assert np.array_equal(_run([np.zeros(n)] * 2)[0], np.zeros(n))
    # opposite gradients: a.b = -|a|^2, so each coefficient is 1.5 and the result is 0
    assert np.array_equal(_run([g, -g])[0], np.zeros(n))


def test_pairwise_formula():
    a, b = np.array([3.0, 0.0]), np.array([1.0, 1.0])
    # a.b = 3, |a|^2 = 9, |b|^2 = 2: (1 - 3/18) a + (1 - 3/4) b
    np.testing.assert_allclose(adasum.combine(a, b), (5 / 6) * a + 0.25 * b)


def test_errors_on_every_rank():
    def body(t):
        return adasum.allreduce(t, np.ones(4), Op.ADASUM, workspace=Workspace())
    for p in (3, 6):
        with pytest.raises(InvalidArgumentError, match=f"power-of-two number of ranks.*this job has {p}"):
            run_threads(p, body, timeout=TIMEOUT)
    with pytest.raises(InvalidArgumentError, match="floating-point"):
        adasum.check(2, np.int32, 0)

    def through_comm(t):
        try:
            Communicator(t).allreduce(np.ones(3), op=Op.ADASUM)
        except InvalidArgumentError as e:
            return str(e)
    messages = run_threads(3, through_comm, timeout=TIMEOUT)
    assert all(m and f"rank {r}:" in m and "has 3" in m for r, m in enumerate(messages))
    with pytest.raises(TypeError, match="Adasum combines floating-point"):
        run_threads(2, lambda t: Communicator(t).allreduce(np.ones(3, np.int64), op=Op.ADASUM), timeout=TIMEOUT)


def test_through_communicator():
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(4)]

    def body(t):
        comm = Communicator(t)
        out = comm.allreduce(inputs[t.rank], op=Op.ADASUM, algorithm="ring")   # Adasum runs its own algorithm
        inplace = inputs[t.rank].copy()
        comm.allreduce_(inplace, op=Op.ADASUM)
        return out, inplace
    results = run_threads(4, body, timeout=TIMEOUT)
    ref = adasum.reference(inputs).reshape(5, 3)
    for out, inplace in results:
        assert out.shape == (5, 3) and out.dtype == np.float32
        assert out.tobytes() == results[0][0].tobytes() == inplace.tobytes()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)

    def mixed(t):                                      # one rank Adasum, the other Sum: a mismatch everywhere
        return Communicator(t).allreduce(np.ones(3), op=Op.ADASUM if t.rank == 0 else Op.SUM)
    with pytest.raises(MismatchError, match="op differs"):
        run_threads(2, mixed, timeout=TIMEOUT)
