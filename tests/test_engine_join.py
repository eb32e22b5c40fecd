"""``join()`` for uneven data (engine.py, negotiation.py) on p engines over thread ranks.

Rank r runs ``3 + r`` steps, then joins; the others go on reducing with its zeros. Every
result is checked against a numpy reference on every rank that asked for it, bitwise the same
on all of them. Horovod's ``Average`` divides by the full size, joined ranks included.
"""
import threading

import numpy as np
import pytest

from allreduce.algorithms import adasum
from allreduce.engine import Compression, Compressor
from allreduce.errors import InvalidArgumentError, MismatchError, ShutdownError
from allreduce.ops import Op

from .engine_util import engines

TIMEOUT = 30


def _ranks(engs, body):
    """Run ``body(rank, engine)`` on one thread per rank; return the results in rank order."""
    out, errors = [None] * len(engs), []

    def run(r):
        try:
            out[r] = body(r, engs[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(engs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank is still running"
    return out


def _data(r: int, step: int, shape, dtype) -> np.ndarray:
    return (np.arange(np.prod(shape)).reshape(shape) % 7 + 3 * r + step).astype(dtype)


# Each step: several small tensors submitted at once (one fused batch), one large one (a direct
# batch), an int Sum, a group, an fp16-compressed one and an Adasum one (p = 2 only).
_TENSORS = [("a", (5,), np.float32, Op.AVERAGE), ("b", (3, 4), np.float64, Op.AVERAGE),
            ("big", (300_000,), np.float32, Op.AVERAGE), ("n", (7,), np.int64, Op.SUM),
            ("mx", (4,), np.float32, Op.MAX)]


def _step(engine, r, step, p):
    handles = {name: engine.submit(_data(r, step, shape, dtype), name=f"{name}.{step}", op=op)
               for name, shape, dtype, op in _TENSORS}
    handles["half"] = engine.submit(_data(r, step, (9,), np.float32), name=f"half.{step}",
                                    compression=Compression.fp16)
    handles["group"] = engine.submit_group([_data(r, step, (2,), np.float32), _data(r, step, (3, 2), np.float32)],
                                           name=f"group.{step}", op=Op.SUM)
    if p == 2:
        handles["adasum"] = engine.submit(_data(r, step, (6,), np.float64), name=f"ada.{step}", op=Op.ADASUM)
    return {name: h.wait(TIMEOUT) for name, h in handles.items()}


def _expected(step, p):
    active = [r for r in range(p) if step < 3 + r]          # rank r runs 3 + r steps
    want = {}
    for name, shape, dtype, op in _TENSORS:
        xs = [_data(r, step, shape, dtype).astype(np.float64) for r in active]
        if op == Op.MAX:                                      # joined ranks contribute zeros
            want[name] = np.maximum(np.max(xs, axis=0), 0 if len(active) < p else -np.inf)
        else:
            want[name] = np.sum(xs, axis=0) / (p if op == Op.AVERAGE else 1)   # Average: / full size
    want["half"] = np.sum([_data(r, step, (9,), np.float32) for r in active], axis=0) / p
    want["group"] = [np.sum([_data(r, step, s, np.float32) for r in active], axis=0) for s in ((2,), (3, 2))]
    if p == 2:
        want["adasum"] = adasum.reference([_data(r, step, (6,), np.float64) for r in active]) if len(active) == 2 \
            else _data(active[0], step, (6,), np.float64)      # adasum(g, 0) = g
    return want


@pytest.mark.parametrize("p", [2, 3])
def test_uneven_steps_then_join(p):
    def body(r, engine):
        results = [_step(engine, r, step, p) for step in range(3 + r)]
        return results, engine.join(TIMEOUT)

    with engines(p) as engs:
        out = _ranks(engs, body)
    for r, (results, last) in enumerate(out):
        assert last == p - 1                                  # the rank with the most steps joins last
        for step, got in enumerate(results):
            want = _expected(step, p)
            for name, value in got.items():
                if name == "group":
                    for g, w in zip(value, want[name]):
                        np.testing.assert_allclose(g, w, rtol=1e-6)
                    continue
                tol = 1e-3 if name == "half" else 1e-12 if value.dtype == np.float64 else 1e-6
                np.testing.assert_allclose(value.astype(np.float64), want[name], rtol=tol, atol=tol,
                                           err_msg=f"rank {r} step {step} tensor {name}")
                first = out[p - 1][0][step][name]                # the rank that ran every step
                assert value.tobytes() == first.tobytes(), f"rank {r} step {step} {name}: not bitwise"


def test_join_twice_and_join_with_work_in_flight():
    """Two rounds of joins in one job; a rank that joins with a tensor still in flight (it was
    submitted first) contributes its data to that tensor and zeros to the rest."""
    def body(r, engine):
        firsts = []
        for rnd in range(2):
            early = engine.submit(np.full(4, r + 1.0), name=f"early.{rnd}", op=Op.SUM)
            if r == 0:
                join = engine.join_async()                    # before waiting: the tensor is in flight
                with pytest.raises(InvalidArgumentError, match="already in progress"):
                    engine.join_async()
                got = [early.wait(TIMEOUT)]
                firsts.append(join.wait(TIMEOUT))
            else:
                late = engine.submit(np.full(3, r + 1.0), name=f"late.{rnd}", op=Op.SUM)
                got = [early.wait(TIMEOUT), late.wait(TIMEOUT)]
                firsts.append(engine.join(TIMEOUT))
            firsts.append(got)
        return firsts

    with engines(3) as engs:
        out = _ranks(engs, body)
    for rnd in (0, 2):                                        # ranks 1 and 2 join after rank 0, in either order
        assert len({o[rnd] for o in out}) == 1 and out[0][rnd] in (1, 2), [o[rnd] for o in out]
    for r, (_, got0, _, got1) in enumerate(out):
        for got in (got0, got1):
            np.testing.assert_array_equal(got[0], np.full(4, 6.0))        # 1 + 2 + 3: rank 0's data counted
            if r:
                np.testing.assert_array_equal(got[1], np.full(3, 5.0))    # 2 + 3: rank 0 gave zeros


def test_custom_compressor_fails_on_every_rank_while_a_rank_is_joined():
    class Scale(Compressor):
        name = "scale2"

        def compress(self, x):
            return np.asarray(x) * 2, None

        def decompress(self, x, ctx):
            return x / 2

    def body(r, engine):
        if r == 0:
            return engine.join(TIMEOUT)
        engine.submit(np.ones(2), name="warm", op=Op.SUM).wait(TIMEOUT)   # rank 0's join is known now
        with pytest.raises(MismatchError, match="joined without it.*custom compressor 'scale2"):
            engine.submit(np.ones(3), name="custom", compression=Scale()).wait(TIMEOUT)
        ok = engine.submit(np.ones(3), name="after", op=Op.SUM).wait(TIMEOUT)
        return ok, engine.join(TIMEOUT)

    with engines(2) as engs:
        out = _ranks(engs, body)
    assert out[0] == 1 and out[1][1] == 1
    np.testing.assert_array_equal(out[1][0], np.ones(3))


def test_shutdown_fails_a_pending_join():
    with engines(2) as engs:
        handle = engs[0].join_async()
        engs[1].shutdown(timeout=10)
        with pytest.raises(ShutdownError):
            handle.wait(TIMEOUT)
