"""Engine failures are per tensor and the same on every rank: mismatches, stalls."""
import logging
import re
import time

import numpy as np
import pytest

from allreduce.errors import MismatchError, StallError
from allreduce.engine import Compression
from allreduce.ops import Op

from .engine_util import engines, submit_all, wait_all


def _good(p, step):
    return {f"ok{i}": [np.full(7 + i, r + step, np.float64) for r in range(p)] for i in range(4)}


def _check_good(results, p, step):
    for name, res in results.items():
        assert all(x.tolist() == [sum(range(p)) + p * step] * x.size for x in res), name


@pytest.mark.parametrize("cached", [False, True], ids=["new-name", "cached-name"])
@pytest.mark.parametrize("field", ["shape", "dtype", "op", "compression"])
def test_mismatch_fails_that_tensor_on_every_rank_and_nothing_else(field, cached):
    p = 3
    with engines(p) as engs:
        if cached:                                        # the name enters the cache first
            wait_all(submit_all(engs, {"bad": [np.ones(4, np.float32)] * p}, op=Op.SUM))
        bad = []
        for r, engine in enumerate(engs):
            x, op, comp = np.ones(4, np.float32), Op.SUM, Compression.none
            if r == 1:
                x = {"shape": np.ones(5, np.float32), "dtype": np.ones(4, np.float64)}.get(field, x)
                op = Op.MAX if field == "op" else op
                comp = Compression.fp16 if field == "compression" else comp
            bad.append(engine.submit(x, name="bad", op=op, compression=comp))
        good = submit_all(engs, _good(p, 0), np.random.default_rng(0), op=Op.SUM)
        messages = []
        for h in bad:
            with pytest.raises(MismatchError) as info:
                h.wait(20)
            messages.append(str(info.value))
        assert len(set(messages)) == 1, "every rank must raise the same message"
        assert f"{field} differs" in messages[0] and "'bad'" in messages[0]
        assert all(f"rank {r}:" in messages[0] for r in range(p))
        _check_good(wait_all(good), p, 0)
        # The engine keeps working, and the name can be used again consistently.
        again = wait_all(submit_all(engs, {"bad": [np.ones(5, np.float32)] * p}, op=Op.SUM))
        assert all(x.tolist() == [3.0] * 5 for x in again["bad"])
        _check_good(wait_all(submit_all(engs, _good(p, 1), op=Op.SUM)), p, 1)


@pytest.mark.parametrize("cached", [False, True], ids=["new-name", "cached-name"])
def test_stall_warns_names_the_missing_ranks_then_fails_with_stall_error(cached, caplog):
    p = 3
    caplog.set_level(logging.WARNING, logger="allreduce.engine")
    with engines(p, stall_check_time=0.2, stall_shutdown_time=0.8) as engs:
        if cached:
            wait_all(submit_all(engs, {"lonely": [np.ones(3)] * p}))
        stalled = [engs[r].submit(np.ones(3), name="lonely") for r in (0, 2)]     # rank 1 never does
        _check_good(wait_all(submit_all(engs, _good(p, 0), op=Op.SUM)), p, 0)   # others go on
        messages = []
        for h in stalled:
            with pytest.raises(StallError) as info:
                h.wait(20)
            messages.append(str(info.value))
        _check_good(wait_all(submit_all(engs, _good(p, 2), op=Op.SUM)), p, 2)
    assert len(set(messages)) == 1, "every rank must raise the same message"
    assert "'lonely'" in messages[0] and "never by rank(s) 1." in messages[0] \
        and "submitted by rank(s) 0, 2" in messages[0]
    warned = [r.getMessage() for r in caplog.records if "'lonely' has waited" in r.getMessage()]
    assert warned and re.search(r"missing on rank\(s\) 1\b", warned[0])


def test_stall_without_shutdown_time_only_warns(caplog):
    caplog.set_level(logging.WARNING, logger="allreduce.engine")
    with engines(2, stall_check_time=0.1) as engs:
        h0 = engs[0].submit(np.ones(2), name="late")
        deadline = time.monotonic() + 20
        while not any("'late'" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not h0.done()
        h1 = engs[1].submit(np.ones(2), name="late")              # arrives after all: no error
        assert h0.wait(10).tolist() == [1, 1] and h1.wait(10).tolist() == [1, 1]
    assert any("'late'" in r.getMessage() and "missing on rank(s) 1" in r.getMessage() for r in caplog.records)


def test_a_peer_that_never_starts_fails_the_handles_instead_of_hanging():
    from allreduce.config import Config
    from allreduce.engine import Engine
    from allreduce.errors import AllreduceError, ShutdownError
    from allreduce.transport.threads import ThreadWorld
    world = ThreadWorld(2, timeout=0.5)                   # rank 1's engine is never started
    engine = Engine(world.transport(0), config=Config(cycle_time=0.5))
    try:
        handle = engine.submit(np.ones(2), name="x")
    except ShutdownError:                                 # the engine may have failed already
        handle = None
    engine._thread.join(20)
    assert not engine.alive
    if handle is not None:
        with pytest.raises(AllreduceError, match="timed out"):
            handle.wait(5)
    with pytest.raises(ShutdownError, match="timed out"):
        engine.submit(np.ones(2), name="y")
    engine.shutdown(timeout=5)


def test_out_of_step_ranks_fail_every_waiting_name_on_every_rank_then_go_on():
    # Rank 1 "failed a step and moved on": it waits for 'next' while ranks 0 and 2 still wait
    # for 'step'. Nobody can go on; within out_of_step_time (not stall_shutdown_time) both
    # names fail on every rank that submitted them, with one message naming who waits for what.
    p = 3
    with engines(p, stall_shutdown_time=600, out_of_step_time=0.3) as engs:
        start = time.monotonic()
        handles = [engs[r].submit(np.ones(4), name="next" if r == 1 else "step") for r in range(p)]
        messages = []
        for h in handles:
            with pytest.raises(StallError) as info:
                h.wait(20)
            messages.append(str(info.value))
        assert time.monotonic() - start < 15, "out of step must fail long before stall_shutdown_time"
        assert "out of step" in messages[0] and "'next' submitted by rank(s) 1, missing on rank(s) 0, 2" \
            in messages[0] and "'step' submitted by rank(s) 0, 2, missing on rank(s) 1" in messages[0]
        assert messages[0] == messages[2] and messages[1].split(":", 1)[1] == messages[0].split(":", 1)[1]
        _check_good(wait_all(submit_all(engs, _good(p, 3), op=Op.SUM)), p, 3)    # in step again: works


@pytest.mark.parametrize("limit", [0, 30])
def test_async_submits_in_different_orders_are_not_out_of_step_when_off_or_patient(limit):
    # allreduce_async in different orders, with work between the submits: for a while every rank
    # waits for a name another lacks, which is legitimate. With out_of_step_time 0 (off) or longer
    # than that while, both names complete with the exact sums instead of failing.
    p = 2
    with engines(p, stall_shutdown_time=600, out_of_step_time=limit) as engs:
        first = [engs[r].submit(np.full(4, r + 1.0), name="a" if r == 0 else "b", op=Op.SUM) for r in range(p)]
        time.sleep(0.6)                                   # well past 0.3 s, the failing test's limit
        second = [engs[r].submit(np.full(4, 10.0 * (r + 1)), name="b" if r == 0 else "a",
                                 op=Op.SUM) for r in range(p)]
        a = [first[0].wait(20), second[1].wait(20)]
        b = [second[0].wait(20), first[1].wait(20)]
        for result in a:
            np.testing.assert_array_equal(result, np.full(4, 1.0 + 20.0))
        for result in b:
            np.testing.assert_array_equal(result, np.full(4, 10.0 + 2.0))


def test_out_of_step_time_is_a_setting():
    from allreduce.config import Config
    assert Config.from_env({"ALLREDUCE_OUT_OF_STEP_TIME": "0"}).out_of_step_time == 0
    with pytest.raises(ValueError, match="out_of_step_time must be >= 0"):
        Config(out_of_step_time=-1)
