"""In-place engine allreduces (``allreduce_async_``): results land in the caller's arrays."""
import numpy as np
import pytest

from allreduce.engine import Compression
from allreduce.engine.fusion import DIRECT_BYTES
from allreduce.errors import InvalidArgumentError
from allreduce.ops import Op

from .engine_util import engines


def _inputs(p, shape, dtype=np.float32, order="C"):
    return [np.asarray(np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * (r + 1), dtype=dtype,
                       order=order) for r in range(p)]


@pytest.mark.parametrize("count", [5, 1000, DIRECT_BYTES // 4 + 3])   # fused, fused, reduced in the array itself
def test_inplace_result_is_the_callers_array(count):
    p = 3
    xs = _inputs(p, (count,))
    want = np.sum([x.astype(np.float64) for x in xs], axis=0)
    with engines(p, fusion_threshold=64 << 20) as engs:
        handles = [e.submit(x, name="g", op=Op.SUM, inplace=True) for e, x in zip(engs, xs)]
        assert not xs[0].flags.writeable, "read-only while in flight"
        results = [h.wait(30) for h in handles]
    for x, got in zip(xs, results):
        assert got is x and x.flags.writeable
        np.testing.assert_allclose(x, want, rtol=1e-6)
    assert all(np.array_equal(xs[0].view(np.uint32), x.view(np.uint32)) for x in xs[1:])


def test_inplace_mixed_with_out_of_place_and_non_contiguous():
    """Ranks may differ in which call they use; a strided array gets its result written back."""
    p = 2
    big = _inputs(p, (DIRECT_BYTES // 4 + 10,))
    small = _inputs(p, (4, 6), order="F")                 # not C-contiguous: reduced in a copy
    with engines(p) as engs:
        hb = [engs[0].submit(big[0], name="big", op=Op.AVERAGE, inplace=True),
              engs[1].submit(big[1], name="big", op=Op.AVERAGE)]
        hs = [e.submit(x[:, ::2], name="small", op=Op.MAX, inplace=True) for e, x in zip(engs, small)]
        rb = [h.wait(30) for h in hb]
        rs = [h.wait(30) for h in hs]
    assert rb[0] is big[0] and rb[1] is not big[1]
    np.testing.assert_array_equal(rb[0], rb[1])
    np.testing.assert_allclose(rb[0], (big[0].astype(np.float64) * 0 + np.arange(big[0].size) * 1.5), rtol=1e-6)
    for x, got in zip(small, rs):
        np.testing.assert_array_equal(got, small[1][:, ::2])     # the max is rank 1's
        assert np.shares_memory(got, x)


def test_inplace_with_fp16_compression():
    p = 2
    xs = [np.full(300, 0.5 * (r + 1), np.float32) for r in range(p)]
    with engines(p) as engs:
        got = [h.wait(30) for h in [e.submit(x, name="c", op=Op.AVERAGE, compression=Compression.fp16,
                                             inplace=True) for e, x in zip(engs, xs)]]
    assert got[0] is xs[0]
    np.testing.assert_allclose(xs[0], 0.75, rtol=1e-3)


def test_inplace_needs_a_writeable_array():
    frozen = np.ones(3, np.float32)
    frozen.flags.writeable = False
    with engines(1) as (eng,):
        with pytest.raises(InvalidArgumentError, match="writeable"):
            eng.submit(frozen, name="x", inplace=True)
        with pytest.raises(InvalidArgumentError, match="writeable"):
            eng.submit([1.0, 2.0], name="y", inplace=True)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_inplace_empty_and_scalar_arrays(dtype):
    """0 elements (an empty array shares no memory with anything) and 0-d arrays, alone in a batch."""
    p = 2
    with engines(p) as engs:
        empty = [np.zeros(0, dtype) for _ in range(p)]
        scalar = [np.array(r + 1, dtype) for r in range(p)]
        he = [e.submit(x, name="empty", op=Op.MIN, inplace=True) for e, x in zip(engs, empty)]
        hs = [e.submit(x, name="scalar", op=Op.SUM, inplace=True) for e, x in zip(engs, scalar)]
        assert all(h.wait(30) is x for h, x in zip(he, empty))
        assert all(h.wait(30) is x and int(x) == 3 for h, x in zip(hs, scalar))
    assert all(x.flags.writeable for x in empty + scalar)


@pytest.mark.parametrize("algorithm", ["shm", "ring"])
def test_large_plain_tensors_share_one_call(algorithm, monkeypatch):
    """Tensors of DIRECT_BYTES and up are reduced in their own result arrays, in one direct batch:
    with shm that is one allreduce_many call (its windows run across the arrays); other algorithms
    take them one by one. Ranks submit in different orders; in place and new arrays mixed."""
    from allreduce.algorithms import shm
    calls = []
    real = shm.allreduce_many
    monkeypatch.setattr(shm, "allreduce_many", lambda comm, bufs, op, **kw: (calls.append(len(bufs)),
                                                                            real(comm, bufs, op, **kw)))
    p, n = 3, DIRECT_BYTES // 4
    sizes = {"a": n, "b": n + 7, "c": 2 * n + 1, "d": n + 3}
    xs = {k: [np.arange(m, dtype=np.float32) % 97 * (r + 1) for r in range(p)] for k, m in sizes.items()}
    want = {k: np.sum([x.astype(np.float64) for x in v], axis=0) / p for k, v in xs.items()}
    copies = {k: [x.copy() for x in v] for k, v in xs.items()}
    with engines(p, algorithm=algorithm, cycle_time=50) as engs:
        handles = {k: [None] * p for k in sizes}
        for r, e in enumerate(engs):
            for k in (list(sizes) if r % 2 == 0 else list(sizes)[::-1]):
                handles[k][r] = e.submit(xs[k][r], name=k, op=Op.AVERAGE, inplace=(k in "ac"))
        got = {k: [h.wait(30) for h in hs] for k, hs in handles.items()}
    for k in sizes:
        for r in range(p):
            assert (got[k][r] is xs[k][r]) == (k in "ac")
            np.testing.assert_allclose(got[k][r], want[k], rtol=1e-6)
            assert got[k][r].tobytes() == got[k][0].tobytes(), f"{k}: rank {r} differs bitwise"
            if k not in "ac":
                assert xs[k][r].tobytes() == copies[k][r].tobytes(), f"{k}: the input changed"
    if algorithm == "shm":
        assert calls and sum(calls) == p * len(sizes) and max(calls) > 1, calls
    else:
        assert not calls
