"""Grouped allreduce: a list of arrays is one engine tensor (one name, one bit, one result)."""
import numpy as np
import pytest

from allreduce.engine import Compression
from allreduce.errors import InvalidArgumentError, MismatchError, ShutdownError
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import Op

from .engine_util import engines

SHAPES = [(3, 4), (), (0,), (5,), (2, 1, 3)]


def _group(rng, p, dtype, shapes=SHAPES):
    return [[rng.integers(-20, 20, s).astype(dtype) for s in shapes] for _ in range(p)]   # [rank][array]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_groups_in_different_orders_match_the_reference(p):
    rng = np.random.default_rng(p)
    groups = {f"g{k}": (_group(rng, p, dt), op) for k, (dt, op) in
              enumerate([(np.float32, Op.AVERAGE), (np.int64, Op.SUM), (np.float64, Op.MAX), (np.int32, Op.MIN)])}
    with engines(p) as engs:
        handles = {name: [None] * p for name in groups}
        for r, e in enumerate(engs):
            order = list(groups)
            rng.shuffle(order)
            for name in order:
                xs, op = groups[name]
                handles[name][r] = e.submit_group(xs[r], name=name, op=op)
        got = {name: [h.wait(30) for h in hs] for name, hs in handles.items()}
        assert all(e.cycles < 200 for e in engs)
    for name, (xs, op) in groups.items():
        for i, shape in enumerate(SHAPES):
            want = allreduce_reference([xs[r][i] for r in range(p)], op)
            for r in range(p):
                assert got[name][r][i].shape == shape and got[name][r][i].dtype == xs[r][i].dtype
                assert got[name][r][i].tobytes() == want.tobytes(), f"{name} array {i} rank {r}"


def test_a_group_leaves_its_inputs_alone_and_can_be_compressed():
    p = 2
    xs = [[np.full(s, 0.25 * (r + 1), np.float32) for s in [(100,), (7, 3)]] for r in range(p)]
    before = [[a.copy() for a in g] for g in xs]
    with engines(p) as engs:
        got = [h.wait(30) for h in [e.submit_group(x, name="c", compression=Compression.fp16)
                                    for e, x in zip(engs, xs)]]
    for r in range(p):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(xs[r], before[r])), "inputs changed"
        for a in got[r]:
            np.testing.assert_allclose(a, 0.375, rtol=1e-3)


def test_different_shapes_fail_the_group_on_every_rank_and_the_engine_goes_on():
    p = 3
    with engines(p) as engs:
        shapes = [[(4,), (2,)], [(4,), (2,)], [(4,), (3,)]]
        bad = [e.submit_group([np.ones(s) for s in shapes[r]], name="g") for r, e in enumerate(engs)]
        for h in bad:
            with pytest.raises(MismatchError, match=r"rank 2: group of 2 arrays \[\(4,\), \(3,\)\]"):
                h.wait(30)
        good = [e.submit_group([np.ones(2), np.ones(3)], name="g2", op=Op.SUM) for e in engs]
        assert all(np.array_equal(h.wait(30)[1], np.full(3, 3.0)) for h in good)


def test_bad_groups_are_refused_before_anything_is_sent():
    with engines(1) as (e,):
        with pytest.raises(InvalidArgumentError, match="at least one array"):
            e.submit_group([], name="empty")
        with pytest.raises(InvalidArgumentError, match="array 1 is float64 and array 0 float32"):
            e.submit_group([np.ones(2, np.float32), np.ones(2)], name="mixed")
        with pytest.raises(TypeError, match="unsupported dtype"):
            e.submit_group([np.array(["a"])], name="str")
        x = np.ones(3)
        h = e.submit(x, name="busy")
        with pytest.raises(InvalidArgumentError, match="already in flight"):
            e.submit(x, name="busy")
        h.wait(30)
    y = np.ones(3)
    with pytest.raises(ShutdownError):
        e.submit(y, name="late")
    assert y.flags.writeable, "a refused submit must give the caller its array back"
