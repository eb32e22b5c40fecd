"""Bad input on the direct path: a specific error on every rank, never a hang or a wrong answer.

Runs p thread ranks in one process; each case asserts what *every* rank saw.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import allreduce as ar
from allreduce import Communicator, Config
from allreduce.errors import AllreduceError, InvalidArgumentError, MismatchError
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import SUPPORTED_DTYPES, Op
from allreduce.transport.threads import run_threads

ALGOS = ["ring", "tree", "rhd", "rd"]


def on_every_rank(p, fn, **config):
    """Run ``fn(comm)`` on p thread ranks; return each rank's result or exception."""
    def body(t):
        try:
            return fn(Communicator(t, config=Config(**config)))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    return run_threads(p, body, timeout=20)


@pytest.mark.parametrize("algo", ALGOS)
def test_read_only_input_works_out_of_place(algo):
    def fn(c):
        x = np.arange(10, dtype=np.float32)
        x.setflags(write=False)
        return c.allreduce(x, ar.Sum, algorithm=algo)
    for r in on_every_rank(3, fn):
        assert np.array_equal(r, np.arange(10, dtype=np.float32) * 3)


def test_in_place_on_read_only_raises_clearly():
    def fn(c):
        x = np.ones(4)
        x.setflags(write=False)
        return c.allreduce_(x, ar.Sum)
    for r in on_every_rank(2, fn):
        assert isinstance(r, ValueError) and "read-only" in str(r)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op", [Op.SUM, Op.AVERAGE, Op.MIN, Op.MAX, Op.PRODUCT], ids=repr)
def test_nan_and_inf_propagate_like_float64(algo, op):
    p = 3
    inputs = [np.array([1.0, np.nan, np.inf, -np.inf, np.inf, 2.0, 0.0], np.float32) for _ in range(p)]
    inputs[1][4] = -np.inf           # inf + -inf = nan
    inputs[2][5] = np.nan
    want = allreduce_reference(inputs, op)

    def fn(c):
        return c.allreduce(inputs[c.rank], op, algorithm=algo)
    results = on_every_rank(p, fn)
    for r in results:
        assert np.array_equal(np.isnan(r), np.isnan(want)), (r, want)
        assert np.array_equal(r[~np.isnan(r)], want[~np.isnan(want)]), (r, want)
        assert r.tobytes() == results[0].tobytes()


def test_wrong_root_rank_raises_on_every_rank():
    for bad in (-1, 3, 1.5, "0", True):
        results = on_every_rank(3, lambda c: c.broadcast(np.ones(2), root_rank=bad))
        for r in results:
            assert isinstance(r, InvalidArgumentError) and "root_rank" in str(r), r
            assert isinstance(r, TypeError) and isinstance(r, ValueError)


def test_mismatch_then_still_usable():
    def fn(c):
        try:
            c.allreduce(np.ones(3 + c.rank), ar.Sum)
        except MismatchError as e:
            first = str(e)
        return first, c.allreduce(np.ones(3), ar.Sum)
    results = on_every_rank(3, fn)
    for text, value in results:
        assert "rank 0: 3, rank 1: 4, rank 2: 5" in text
        assert np.array_equal(value, [3.0, 3.0, 3.0])


# -- fuzz: generated metadata reaches the public API ---------------------------------------

DTYPES = st.sampled_from([*SUPPORTED_DTYPES, np.dtype(np.complex64), np.dtype("M8[s]"), np.dtype("U3"),
                          np.dtype(object), np.dtype(np.uint32), np.dtype(np.float128)])
OPS = st.one_of(st.sampled_from(list(Op)), st.integers(-3, 8), st.sampled_from(["sum", None, 1.0]))
ALGORITHMS = st.sampled_from(["auto", *ALGOS, "mpi", "RING", "", "bogus"])
SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=DTYPES, op=OPS, algorithm=ALGORITHMS, shape=SHAPES, p=st.integers(1, 4),
       segment=st.integers(-5, 1 << 16), strided=st.booleans())
def test_fuzz_public_api(dtype, op, algorithm, shape, p, segment, strided):
    """Each case is either a correct result on every rank or a documented exception on every rank."""
    try:
        config = dict(segment_bytes=segment)
        Config(**config)
    except ValueError as e:
        assert "segment_bytes" in str(e)
        return
    rng = np.random.default_rng(abs(hash((str(dtype), shape))) % 2**32)
    base = [(rng.integers(0, 3, size=tuple(n * 2 for n in shape) if strided else shape)).astype(dtype)
            for _ in range(p)]
    # (a 0-d array has nothing to stride: indexing it with () would give a scalar, not an array)
    inputs = [x[tuple(slice(None, None, 2) for _ in shape)] if strided and shape else x for x in base]

    def fn(c):
        return c.allreduce(inputs[c.rank], op, algorithm=algorithm)
    results = on_every_rank(p, fn, **config)
    kinds = {type(r) for r in results}
    assert len(kinds) == 1, f"ranks disagree: {results}"     # all fail alike, or all succeed
    r = results[0]
    if isinstance(r, Exception):
        assert isinstance(r, (TypeError, ValueError, AllreduceError)), repr(r)
        assert str(r), "an error must say what is wrong"
        return
    want = allreduce_reference([np.ascontiguousarray(x).reshape(-1) for x in inputs], Op(op)).reshape(inputs[0].shape)
    for got in results:
        assert got.shape == inputs[0].shape and got.dtype == inputs[0].dtype
        assert got.tobytes() == results[0].tobytes()
    np.testing.assert_allclose(results[0].astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=1e-2)
