"""Communication hooks in the engine on thread ranks: PowerSGD, OneBit, agreement, state, bad input.

References: numpy float64 averages, and the engine's own plain allreduce (exact on integer-valued
float64 inputs). Every result is also checked bitwise identical on every rank.
"""
import numpy as np
import pytest

import allreduce as ar
from allreduce.engine import Compression
from allreduce.engine.powersgd import matrix_shape, orthonormalise
from allreduce.errors import InvalidArgumentError, MismatchError
from allreduce.ops import Op

from .engine_util import engines


def _step(engs, hooks, tensors, op=Op.AVERAGE, timeout=20):
    """Every rank submits every tensor (rank r in reversed order when r is odd); {name: results}."""
    handles = {}
    for r, e in enumerate(engs):
        names = list(tensors)[::-1] if r % 2 else list(tensors)
        for name in names:
            handles.setdefault(name, [None] * len(engs))[r] = e.submit(
                tensors[name][r], name=name, op=op, comm_hook=None if hooks is None else hooks[r])
    results = {name: [h.wait(timeout) for h in hs] for name, hs in handles.items()}
    for name, res in results.items():
        assert all(x.tobytes() == res[0].tobytes() for x in res), f"{name}: ranks differ bitwise"
        assert res[0].shape == tensors[name][0].shape and res[0].dtype == tensors[name][0].dtype
    return results


def _random(rng, p, shapes, dtype=np.float32):
    return {f"t{i}": [rng.standard_normal(s).astype(dtype) for _ in range(p)] for i, s in enumerate(shapes)}


@pytest.mark.parametrize("op", [Op.AVERAGE, Op.SUM])
def test_full_rank_powersgd_is_plain_allreduce_to_float32_rounding(op):
    p, shapes = 3, [(6, 4), (5, 8), (3, 3, 4), (9,)]
    tensors = _random(np.random.default_rng(1), p, shapes)
    hooks = [ar.PowerSGD(rank=8, start_iter=0, min_compression_rate=0) for _ in range(p)]
    assert all(hooks[0].compresses(s) for s in shapes)           # every one goes the low-rank way
    with engines(p) as engs:
        for _ in range(2):                                      # the warm-started step too
            results = _step(engs, hooks, tensors, op)
            for name, xs in tensors.items():
                want = np.sum(np.array(xs, np.float64), axis=0) / (p if op == Op.AVERAGE else 1)
                scale = np.abs(np.array(xs, np.float64)).sum(axis=0).max()
                np.testing.assert_allclose(results[name][0], want, rtol=0, atol=2e-6 * scale, err_msg=name)


def test_vectors_small_tensors_and_early_steps_are_exactly_plain_allreduce():
    """Integer-valued float64: every sum is exact, so 'exactly plain' is testable bit for bit."""
    p, rng = 3, np.random.default_rng(2)
    shapes = [(7,), (), (3, 3), (0,), (2, 50), (0, 4), (16, 16)]
    tensors = {f"t{i}": [rng.integers(-50, 50, s).astype(np.float64) for _ in range(p)]
               for i, s in enumerate(shapes)}
    hook = ar.PowerSGD(rank=1, start_iter=2)               # only (16, 16) passes the rule, from step 3
    assert [bool(hook.compresses(s)) for s in shapes] == [False] * 6 + [True]
    hooks = [ar.PowerSGD(rank=1, start_iter=2) for _ in range(p)]
    with engines(p) as engs:
        plain = _step(engs, None, tensors, Op.SUM)
        for step in range(3):
            hooked = _step(engs, hooks, tensors, Op.SUM)
            for name in tensors:
                same = hooked[name][0].tobytes() == plain[name][0].tobytes()
                if name == "t6" and step == 2:                  # start_iter reached: rank 1 now
                    assert not same and np.linalg.matrix_rank(hooked[name][0]) == 1
                else:
                    assert same, (name, step)


@pytest.mark.parametrize("kind,bound", [("powersgd", 10), ("onebit", 25)])
def test_error_feedback_makes_the_mean_output_converge_to_the_mean(kind, bound):
    """A constant gradient per rank: with error feedback, mean(outputs over T) - mean(gradients)
    shrinks like 1/T (|error| * T / max|mean| stays under ``bound``); without it, it does not."""
    p, rng = 2, np.random.default_rng(0)
    grads = [rng.standard_normal((12, 10)).astype(np.float32) for _ in range(p)]
    want = np.mean(np.array(grads, np.float64), axis=0)
    make = {"powersgd": lambda ef: ar.PowerSGD(rank=1, start_iter=0, error_feedback=ef),
            "onebit": lambda ef: ar.OneBit()}[kind]
    for ef in ([True, False] if kind == "powersgd" else [True]):
        hooks = [make(ef) for _ in range(p)]
        with engines(p) as engs:
            total, ratios = np.zeros_like(want), {}
            for t in range(1, 201):
                total += _step(engs, hooks, {"g": grads})["g"][0]
                if t in (50, 200):
                    ratios[t] = np.abs(total / t - want).max() * t / np.abs(want).max()
        if ef:
            assert max(ratios.values()) < bound, ratios
        else:                                               # the bias stays: error * T grows with T
            assert ratios[200] > 5 * bound, ratios


def test_onebit_sends_signs_and_sum_is_p_times_average():
    p, rng = 3, np.random.default_rng(3)
    tensors = _random(rng, p, [(37,), (4, 5)])
    with engines(p) as engs:
        avg = _step(engs, [ar.OneBit() for _ in range(p)], tensors)
        tot = _step(engs, [ar.OneBit() for _ in range(p)], tensors, Op.SUM)
    for name in tensors:                        # one chunk per owner: at most p magnitudes
        assert len(np.unique(np.abs(avg[name][0]))) <= p
        np.testing.assert_array_equal(tot[name][0], avg[name][0] * np.float32(p))


def test_hook_settings_that_differ_raise_on_every_rank_naming_each_value():
    p = 3
    with engines(p) as engs:
        hooks = [ar.PowerSGD(rank=2 if r == 1 else 1, start_iter=0) for r in range(p)]
        hooks[2] = None                                       # rank 2: no hook at all
        handles = [e.submit(np.ones((8, 8), np.float32), name="w", comm_hook=hooks[r]) for r, e in enumerate(engs)]
        messages = []
        for h in handles:
            with pytest.raises(MismatchError) as info:
                h.wait(20)
            messages.append(str(info.value))
        assert len(set(messages)) == 1, "every rank must raise the same message"
        assert "rank 0: PowerSGD(rank=1," in messages[0] and "rank 1: PowerSGD(rank=2," in messages[0]
        assert "rank 2: none" in messages[0]
        ok = _step(engs, [ar.OneBit() for _ in range(p)], {"v": [np.ones(5, np.float32)] * p})   # goes on
        assert ok["v"][0].tolist() == [1.0] * 5


def test_state_starts_fresh_on_a_new_communicator_and_on_reset():
    """After 3 steps on 2 ranks the tensor is compressed (start_iter=2); the same hook objects on
    a new engine of 3 ranks (a recovery's new communicator) start over: plain again, step 1."""
    rng = np.random.default_rng(4)
    x = {"w": [rng.integers(-9, 9, (8, 8)).astype(np.float64) for _ in range(3)]}
    hooks = [ar.PowerSGD(rank=1, start_iter=2, min_compression_rate=1) for _ in range(3)]
    exact = {"w": np.sum(x["w"], axis=0)}
    with engines(2) as old:
        for _ in range(3):
            low = _step(old, hooks[:2], {"w": x["w"][:2]}, Op.SUM)
        assert np.linalg.matrix_rank(low["w"][0]) == 1
        old_comm = old[0].comm
        assert hooks[0].state(old_comm)["steps"] == {"w": 3}
    with engines(3) as new:
        for step in range(3):
            got = _step(new, hooks, x, Op.SUM)["w"][0]
            assert np.array_equal(got, exact["w"]) == (step < 2), step    # plain: the count restarted
        assert hooks[0].state(new[0].comm)["steps"] == {"w": 3}
        assert hooks[0].state(old_comm)["steps"] == {"w": 3}             # the old one's is its own
        for h in hooks:
            h.reset()
        assert hooks[0].state(old_comm) == {}
        assert np.array_equal(_step(new, hooks, x, Op.SUM)["w"][0], exact["w"])   # plain again


def test_compression_is_a_hook_and_bad_hook_arguments_raise_before_anything_is_sent():
    with engines(2) as engs:
        res = _step(engs, [Compression.fp16] * 2, {"h": [np.full(4, 1.5, np.float32)] * 2})
        assert res["h"][0].tolist() == [1.5] * 4
        e, hook = engs[0], ar.PowerSGD(start_iter=0)
        for kwargs, match in [
                (dict(x=np.ones(4, np.int32)), "float32 and float64"),
                (dict(x=np.ones(4, np.float32), op=Op.MAX), "Sum or an Average"),
                (dict(x=np.ones(4, np.float32), compression=Compression.fp16), "not both"),
                (dict(x=np.ones(4, np.float32), hook=object()), "must be an ar.CommHook"),
                (dict(x=np.ones(4, np.float32), name=None), "per tensor name; name the tensor")]:
            x = kwargs.pop("x")
            with pytest.raises(InvalidArgumentError, match=match):
                e.submit(x, name=kwargs.pop("name", "bad"), comm_hook=kwargs.pop("hook", hook), **kwargs)
        with pytest.raises(InvalidArgumentError, match="submit the arrays one by one"):
            e.submit_group([np.ones((4, 4), np.float32)], name="g", comm_hook=hook)
    for bad in [dict(rank=0), dict(start_iter=-1), dict(min_compression_rate=-1)]:
        with pytest.raises(InvalidArgumentError):
            ar.PowerSGD(**bad)


def test_matrix_view_and_orthonormalise_keep_a_zero_column_zero():
    assert [matrix_shape(s) for s in [(), (5,), (3, 4), (2, 3, 4)]] == [(1, 1), (1, 5), (3, 4), (6, 4)]
    p = np.array([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0], [0.0, 1.0, 0.0]])    # col 1 half dependent, col 2 zero
    orthonormalise(p, 1e-30)
    assert np.allclose(p[:, :2].T @ p[:, :2], np.eye(2)) and not p[:, 2].any()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_onebit_sign_kernels_match_numpy(n):
    from allreduce.engine.onebit import compress_signs, decompress_signs
    for dtype in (np.float32, np.float64):
        x = np.random.default_rng(n).standard_normal(n).astype(dtype)
        x[::3] = 0.0                                          # the sign of 0 is +
        bits, scale, error = compress_signs(x)
        approx = np.where(x >= 0, scale, -scale).astype(dtype)
        assert np.array_equal(bits, np.packbits(x >= 0))
        assert np.isclose(scale, np.abs(x.astype(np.float64)).mean() if n else 0.0, rtol=1e-12, atol=0)
        assert np.array_equal(error, x - approx)
        assert np.array_equal(decompress_signs(bits, scale, n, dtype), approx)


@pytest.mark.parametrize("kind", ["powersgd", "onebit"])
def test_a_name_whose_shape_or_dtype_changes_starts_its_state_over(kind):
    p, rng = 2, np.random.default_rng(5)
    hooks = [ar.PowerSGD(rank=16, start_iter=0, min_compression_rate=0) if kind == "powersgd" else ar.OneBit()
             for _ in range(p)]
    with engines(p) as engs:
        for shape, dtype in [((8, 8), np.float32), ((4, 16), np.float32), ((4, 16), np.float64), ((3,), np.float64)]:
            x = {"w": [rng.standard_normal(shape).astype(dtype) for _ in range(p)]}
            got = _step(engs, hooks, x)["w"][0]                     # (bitwise the same on both ranks)
            if kind == "powersgd":
                np.testing.assert_allclose(got, np.mean(x["w"], axis=0), atol=1e-5)


class _Plain(ar.CommHook):
    """A user's hook: one plain allreduce of the bucket (or, ``broken``, one result too few)."""

    def __init__(self, broken=False):
        self.broken, self.name = broken, f"Plain(broken={broken})"

    def reduce(self, bucket, comm, state):
        state.setdefault("buckets", []).append(len(bucket))
        buf = np.concatenate(bucket.arrays)
        comm.allreduce(buf, bucket.op)
        parts = np.split(buf, np.cumsum([a.size for a in bucket.arrays])[:-1])
        return parts[:-1] if self.broken else parts


def test_a_users_hook_runs_per_bucket_and_a_bad_return_fails_that_bucket_on_every_rank():
    p = 3
    tensors = {f"t{i}": [np.full((2, 3), r + i, np.float64) for r in range(p)] for i in range(3)}
    hooks = [_Plain() for _ in range(p)]
    with engines(p, cycle_time=50) as engs:
        res = _step(engs, hooks, tensors, Op.SUM)
        assert all(res[f"t{i}"][0].tolist() == [[3.0 + 3 * i] * 3] * 2 for i in range(3))
        assert sum(hooks[0].state(engs[0].comm)["buckets"]) == 3           # fused (usually one bucket of 3)
        bad = [e.submit(np.ones(4), name="b", comm_hook=_Plain(broken=True)) for e in engs]
        messages = set()
        for h in bad:
            with pytest.raises(ar.AllreduceError, match="returned 0 results for a bucket of 1") as info:
                h.wait(20)
            messages.add(str(info.value).split(":", 1)[1])             # the same after "rank r:"
        assert len(messages) == 1
        assert _step(engs, hooks, {"after": [np.ones(2)] * p}, Op.SUM)["after"][0].tolist() == [3.0, 3.0]


def _mismatch_everywhere(engs, hooks, x) -> str:
    """Every rank submits ``x`` through its hook; every rank must raise the same MismatchError."""
    handles = [e.submit(x[r], name="w", comm_hook=hooks[r]) for r, e in enumerate(engs)]
    messages = set()
    for h in handles:
        with pytest.raises(MismatchError) as info:
            h.wait(20)                                  # before the fix: the transport's timeout
        messages.add(str(info.value))
    assert len(messages) == 1, messages
    return messages.pop()


@pytest.mark.parametrize("kind", ["powersgd", "onebit"])
def test_a_reset_or_a_new_hook_on_some_ranks_only_raises_on_every_rank(kind):
    """A hook's state age travels with its settings: a reset() on rank 1 only, or a new hook object
    on rank 2 only, fails the next step's tensor on every rank naming each side (once the ranks
    reduced it through PowerSGD's low-rank path and the reset rank a plain allreduce, so their
    collectives differed and every rank waited until the transport gave up). A reset on every
    rank goes on, from the same state as new hooks."""
    p, rng = 3, np.random.default_rng(6)
    x = {"w": [rng.integers(-9, 9, (8, 8)).astype(np.float64) for _ in range(p)]}

    def make():
        return ar.PowerSGD(rank=1, start_iter=1, min_compression_rate=1) if kind == "powersgd" else ar.OneBit()
    hooks = [make() for _ in range(p)]
    name = hooks[0].name
    with engines(p) as engs:
        for _ in range(2):
            _step(engs, hooks, x, Op.SUM)
        hooks[1].reset()
        message = _mismatch_everywhere(engs, hooks, x["w"])
        assert f"rank 0: {name}, state from earlier steps" in message, message
        assert f"rank 1: {name}, new state" in message, message
        assert "reset on every rank alike" in message, message
        for h in hooks:                                 # the cure: every rank alike
            h.reset()
        first = _step(engs, hooks, x, Op.SUM)["w"][0]
        hooks[2] = make()                               # a new object on rank 2 only
        message = _mismatch_everywhere(engs, hooks, x["w"])
        assert f"rank 2: {name}, new state" in message and f"rank 1: {name}, state from" in message, message
        fresh = [make() for _ in range(p)]              # new hooks everywhere: the same as a reset
        assert _step(engs, fresh, x, Op.SUM)["w"][0].tobytes() == first.tobytes()
        assert _step(engs, [Compression.fp16] * p, x, Op.SUM)["w"][0].tolist() == np.sum(x["w"], axis=0).tolist()
