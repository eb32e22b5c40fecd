"""The engine on p threads: random submission orders, fusion, the response cache, shutdown."""
import threading
import time

import numpy as np
import pytest

from allreduce.errors import InvalidArgumentError, ShutdownError
from allreduce.ops import SUPPORTED_DTYPES, Op

from .engine_util import engines, submit_all, wait_all
from .harness import assert_allreduce_ok, make_inputs

SIZES = [0, 1, 3, 17, 100, 1001, 5000]


def _step_tensors(rng, p, names):
    """name -> (inputs per rank, op); the name fixes dtype, size and op, as a model's gradients do."""
    out = {}
    for i, name in enumerate(names):
        dtype = SUPPORTED_DTYPES[i % len(SUPPORTED_DTYPES)]
        op = list(Op)[i % len(Op)]
        out[name] = (make_inputs(rng, p, SIZES[i % len(SIZES)], dtype, op), op)
    return out


def _hooked(inputs, op, hook):
    """Whether a comm hook takes this tensor (float32/float64, Sum or Average; not empty)."""
    return hook and inputs[0].dtype in (np.float32, np.float64) and op in (Op.SUM, Op.AVERAGE) \
        and inputs[0].size > 0


def _assert_close_to_reference(results, inputs, op):
    """Bitwise identical on every rank, and the float64 reference within rounding of the inputs."""
    assert all(r.tobytes() == results[0].tobytes() and r.shape == inputs[0].shape for r in results)
    stacked = np.array(inputs, np.float64)
    want = stacked.sum(axis=0) / (len(inputs) if op == Op.AVERAGE else 1)
    eps = np.finfo(inputs[0].dtype).eps
    np.testing.assert_allclose(results[0], want, rtol=0, atol=32 * eps * np.abs(stacked).sum(axis=0).max())


@pytest.mark.parametrize("p,hook", [(2, False), (3, False), (4, False), (3, True)],
                         ids=["p2", "p3", "p4", "p3-powersgd-hook"])
def test_random_orders_many_dtypes_and_sizes(p, hook):
    """Any order on every rank. With ``hook``, the float Sum/Average tensors go through a
    full-rank PowerSGD hook (the plain average up to rounding), fused beside plain ones."""
    from allreduce.engine import PowerSGD
    rng = np.random.default_rng(p)
    names = [f"layer{i}/grad" for i in range(16)]
    steps = {2: 60, 3: 40, 4: 30}[p]
    hooks = [PowerSGD(rank=64, start_iter=1, min_compression_rate=0) for _ in range(p)]
    with engines(p, fusion_threshold=16 << 10) as engs:
        for _ in range(steps):
            tensors = _step_tensors(rng, p, names)
            handles = {}
            for r, engine in enumerate(engs):                     # each rank in its own order
                for name in rng.permutation(names):
                    inputs, op = tensors[name]
                    handles.setdefault(name, [None] * p)[r] = engine.submit(
                        inputs[r], name=name, op=op, comm_hook=hooks[r] if _hooked(inputs, op, hook) else None)
            for name, (inputs, op) in tensors.items():
                check = _assert_close_to_reference if _hooked(inputs, op, hook) else assert_allreduce_ok
                check([h.wait(30) for h in handles[name]], inputs, op)
        stats = engs[0].negotiator.stats
    assert stats["slow"] < steps, "steady state must use the cache, not a gather of names per step"


def test_shapes_are_kept_and_non_contiguous_inputs_work():
    rng = np.random.default_rng(0)
    base = [rng.standard_normal((6, 8)).astype(np.float32) for _ in range(2)]
    inputs = {"t": [b.T for b in base], "s": [b[::2, 1:] for b in base]}
    with engines(2) as engs:
        results = wait_all(submit_all(engs, inputs, op=Op.SUM))
    for name, xs in inputs.items():
        assert_allreduce_ok(results[name], [np.ascontiguousarray(x) for x in xs], Op.SUM)


@pytest.mark.parametrize("cache_capacity", [0, 3])
def test_small_or_no_cache_still_correct(cache_capacity):
    rng = np.random.default_rng(cache_capacity)
    with engines(3, cache_capacity=cache_capacity) as engs:
        for _ in range(10):
            inputs = {f"g{i}": make_inputs(rng, 3, 50 + i, np.float64, Op.SUM) for i in range(8)}
            results = wait_all(submit_all(engs, inputs, rng, op=Op.SUM))
            for name, xs in inputs.items():
                assert_allreduce_ok(results[name], xs, Op.SUM)
        assert len([n for n in engs[0].negotiator.names if n]) <= cache_capacity


def test_fusion_on_and_off_give_the_same_results():
    rng = np.random.default_rng(7)
    # Integer-valued floats: every sum is exact, so any difference is a packing bug.
    inputs = {f"w{i}": [rng.integers(-50, 50, 10 + 97 * i).astype(np.float32) for _ in range(3)]
              for i in range(12)}
    inputs.update({f"i{i}": [rng.integers(-9, 9, 33 * i + 1).astype(np.int32) for _ in range(3)]
                   for i in range(5)})
    outs = []
    for threshold in (0, 1 << 12, 64 << 20):
        with engines(3, fusion_threshold=threshold) as engs:
            outs.append(wait_all(submit_all(engs, inputs, np.random.default_rng(threshold), op=Op.SUM)))
    for name in inputs:
        for out in outs[1:]:
            assert all(a.tobytes() == b.tobytes() for a, b in zip(outs[0][name], out[name])), name


def test_idle_cycles_are_tiny_and_steady_state_skips_the_gather():
    with engines(2, cycle_time=1.0) as engs:
        inputs = {f"g{i}": [np.full(4, r + i, np.float32) for r in range(2)] for i in range(5)}
        wait_all(submit_all(engs, inputs))
        slow = engs[0].negotiator.stats["slow"]
        for _ in range(20):
            wait_all(submit_all(engs, inputs, np.random.default_rng(1)))
        assert engs[0].negotiator.stats["slow"] == slow       # cached: no more name gathers
        tiny = engs[0].negotiator.stats["tiny"]
        deadline = time.monotonic() + 20
        while engs[0].negotiator.stats["tiny"] < tiny + 10 and time.monotonic() < deadline:
            time.sleep(0.01)                                 # idle: flags-only exchanges
        assert engs[0].negotiator.stats["tiny"] >= tiny + 10
        assert engs[0].negotiator._vec.size == 4


def test_unnamed_tensors_are_named_by_call_order():
    with engines(2) as engs:
        handles = [[e.submit(np.full(3, r * 10 + k, np.int64), op=Op.SUM) for k in range(4)]
                   for r, e in enumerate(engs)]
        for k in range(4):
            assert [h.name for h in (handles[0][k], handles[1][k])] == [f"allreduce.noname.{k}"] * 2
            assert handles[0][k].wait(10).tolist() == [10 + 2 * k] * 3


def test_handle_done_and_duplicate_name():
    with engines(2, cycle_time=5.0) as engs:
        h0 = engs[0].submit(np.ones(3), name="x")
        with pytest.raises(InvalidArgumentError, match="already in flight"):
            engs[0].submit(np.ones(3), name="x")
        assert not h0.done()
        h1 = engs[1].submit(np.ones(3), name="x")
        assert h0.wait(10).tolist() == [1, 1, 1] and h0.done() and h1.wait(10).tolist() == [1, 1, 1]
        h2 = engs[0].submit(np.ones(3), name="x")       # done: the name may be used again
        engs[1].submit(np.ones(3), name="x").wait(10)
        h2.wait(10)


def test_bad_arguments_raise_before_anything_is_sent():
    with engines(1) as (engine,):
        with pytest.raises(TypeError, match="unsupported dtype"):
            engine.submit(np.array(["a"]), name="s")
        with pytest.raises(TypeError, match="op must be"):
            engine.submit(np.ones(2), name="o", op="sum")
        with pytest.raises(TypeError, match="compress"):
            engine.submit(np.ones(2), name="c", compression="fp16")
        for bad in ("", 3):
            with pytest.raises(InvalidArgumentError, match="name must be"):
                engine.submit(np.ones(2), name=bad)
        assert engine.submit(np.arange(4.0), name="single").wait(10).tolist() == [0, 1, 2, 3]


def test_shutdown_fails_what_is_not_ready_and_refuses_new_work():
    with engines(3) as engs:
        ok = [e.submit(np.full(2, r, np.float64), name="both", op=Op.SUM) for r, e in enumerate(engs)]
        lonely = engs[1].submit(np.ones(2), name="only-rank-1")
        assert ok[0].wait(10).tolist() == [3, 3]
        engs[0].shutdown(timeout=10)                          # any rank stops every rank
        for e in engs:
            e._thread.join(10)
            assert not e.alive
        with pytest.raises(ShutdownError):
            lonely.wait(10)
        with pytest.raises(ShutdownError, match="shut down"):
            engs[2].submit(np.ones(2), name="late")


@pytest.mark.parametrize("capacity", [2, 1024])
def test_ranks_submitting_from_their_own_threads_at_random_times(capacity):
    """Each rank is a user thread with its own timing; names change shape over time (cache eviction)."""
    import threading
    p, steps = 3, 25
    errors = []
    with engines(p, cache_capacity=capacity, cycle_time=0.3) as engs:
        def rank_body(r):
            try:
                rng = np.random.default_rng([r, capacity])
                for step in range(steps):
                    shared = np.random.default_rng(step)           # same names and shapes on every rank
                    names = [f"n{i}" for i in shared.choice(10, size=5, replace=False)]
                    sizes = {n: int(shared.integers(0, 3)) * 7 + 1 for n in names}   # shapes change
                    handles = {}
                    for n in rng.permutation(names):
                        if rng.random() < 0.3:
                            time.sleep(rng.random() * 2e-3)          # arrive late now and then
                        handles[n] = engs[r].submit(np.full(sizes[n], r + step, np.int64), name=n, op=Op.SUM)
                    for n, h in handles.items():
                        want = sum(range(p)) + p * step
                        assert h.wait(30).tolist() == [want] * sizes[n], (r, step, n)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors[0]


def test_long_idle_stretches_cycles_in_lockstep_and_a_submit_still_completes():
    from allreduce.engine.pacing import IDLE_CYCLES, IDLE_FACTOR
    with engines(2, cycle_time=0.1) as engs:
        deadline = time.monotonic() + 30
        while engs[0].negotiator.idle < IDLE_CYCLES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engs[0].negotiator.idle >= IDLE_CYCLES
        before, t0 = engs[0].cycles, time.monotonic()
        time.sleep(0.2)
        rate = (engs[0].cycles - before) / (time.monotonic() - t0)
        assert rate <= 1.5 * 1000 / (0.1 * IDLE_FACTOR), f"{rate:.0f} idle cycles/s"
        full = engs[0].negotiator.stats["full"]
        handles = [e.submit(np.full(2, r, np.int32), name="wake", op=Op.SUM) for r, e in enumerate(engs)]
        assert [h.wait(10).tolist() for h in handles] == [[1, 1], [1, 1]]
        assert engs[0].negotiator.stats["full"] > full     # a cycle with work ran (and reset the idle count)


def test_engine_settings_come_from_the_environment_once():
    from allreduce.config import Config
    env = {"ALLREDUCE_CYCLE_TIME": "2.5", "ALLREDUCE_FUSION_THRESHOLD": "0", "ALLREDUCE_ENGINE": "0",
           "ALLREDUCE_CACHE_CAPACITY": "7", "ALLREDUCE_STALL_CHECK_TIME": "5",
           "ALLREDUCE_STALL_SHUTDOWN_TIME": "9", "ALLREDUCE_TIMELINE": "/tmp/tl.json"}
    c = Config.from_env(env)
    assert (c.cycle_time, c.fusion_threshold, c.engine, c.cache_capacity, c.stall_check_time,
            c.stall_shutdown_time, c.timeline) == (2.5, 0, False, 7, 5.0, 9.0, "/tmp/tl.json")
    assert Config.from_env(env, fusion_threshold=5).fusion_threshold == 5
    with pytest.raises(ValueError, match="cycle_time"):
        Config.from_env({"ALLREDUCE_CYCLE_TIME": "0"})
    with pytest.raises(ValueError, match="fusion_threshold"):
        Config(fusion_threshold=-1)


def test_rank_masks_span_several_words_beyond_63_ranks():
    from allreduce.engine.negotiation import Negotiator
    neg = Negotiator(0, 130, None, None)
    assert neg.words == 3 and neg._full.tolist() == [2 ** 63 - 1, 2 ** 63 - 1, 15]
    assert sorted(neg._ranks(np.array([5, 0, 3], np.int64))) == [0, 2, 126, 127]
    assert neg._ranks(neg._full) == frozenset(range(130))


def test_partial_names_get_the_ranks_of_their_own_mask():
    """Negotiation reads each partial name's ready ranks from its mask (computed once per distinct
    mask): rank 0 of 3, where rank 2 is ready for the even names and no peer for the odd ones."""
    from allreduce.engine.compression import Compression
    from allreduce.engine.handle import Entry
    from allreduce.engine.negotiation import Negotiator
    names = [f"t{i}" for i in range(7)]
    neg = Negotiator(0, 3, lambda vec, op: None, lambda records: [records] * 3)
    entries = {n: Entry(n, np.ones(2, np.float32), Op.SUM, Compression.none) for n in names}
    assert neg.negotiate(entries, shutdown=False, cutoff=-1).ready == names     # now cached everywhere

    def peers(vec, op):                               # rank 2's bits: the even cache positions
        vec[4 + np.array([neg.positions[n] for n in names[::2]])] |= 1 << 2
    neg._allreduce, neg.tiny = peers, False
    entries = {n: Entry(n, np.ones(2, np.float32), Op.SUM, Compression.none) for n in names}
    out = neg.negotiate(entries, shutdown=False, cutoff=-1)
    assert out.ready == [] and sorted(neg.partial) == names
    assert all(neg.partial[n][2] == ({0, 2} if i % 2 == 0 else {0}) for i, n in enumerate(names))


def test_a_waiting_caller_ends_the_burst_and_fused_results_leave_inputs_alone():
    """The engine waits for submits to pause (BURST_GAP x cycle_time) before a cycle, unless a caller
    already blocks on a handle: then it starts at once. A plain fused batch is reduced in its packed
    array, so the results share memory with each other and never with the inputs."""
    from allreduce.engine.pacing import BURST_GAP
    cycle = 2000.0                                  # ms: a burst gap of 0.4 s would be unmistakable
    with engines(2, cycle_time=cycle) as engs:
        inputs = [[np.full(5, r + 1.0), np.full(3, 10.0 * (r + 1))] for r in range(2)]
        results: list = [None, None]

        def rank_body(r):                           # as in a process: each rank waits for its own
            handles = [engs[r].submit(x, name=f"t{i}", op=Op.SUM) for i, x in enumerate(inputs[r])]
            results[r] = [h.wait(30) for h in handles]
        threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(2)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert time.monotonic() - start < BURST_GAP * cycle / 1000.0
        for r in range(2):
            assert results[r][0].tolist() == [3.0] * 5 and results[r][1].tolist() == [30.0] * 3
            assert np.shares_memory(results[r][0].base, results[r][1].base)   # one packed array
            assert not any(np.shares_memory(y, x) for y in results[r] for x in inputs[r])
            assert inputs[r][0].tolist() == [r + 1.0] * 5                      # inputs untouched


def test_result_memory_is_recycled_only_after_the_caller_drops_it():
    """Results come from a pool (fresh pages cost more than the reduction): a result the caller
    still holds is never written again, and memory of dropped results is used for later steps."""
    sizes = {"fused.a": 50_000, "fused.b": 60_000, "direct": 300_000}     # float32: 200 KB, 240 KB, 1.2 MB

    def step(engs, value):
        handles = [{n: e.submit(np.full(k, value + r, np.float32), name=n, op=Op.SUM) for n, k in sizes.items()}
                   for r, e in enumerate(engs)]
        return [{n: h.wait(30) for n, h in hs.items()} for hs in handles]

    with engines(2) as engs:
        first = step(engs, 1.0)                     # held below
        second = step(engs, 10.0)
        for r in range(2):
            for n, k in sizes.items():
                assert first[r][n].tolist() == [3.0] * k and second[r][n].tolist() == [21.0] * k
                assert not np.shares_memory(first[r][n], second[r][n])
        before = {a.ctypes.data for res in first for a in res.values()}
        del first
        third = step(engs, 100.0)
        for r in range(2):
            assert all(third[r][n].tolist() == [201.0] * k for n, k in sizes.items())
            assert all(not np.shares_memory(third[r][n], second[r][n]) for n in sizes)
        assert before & {a.ctypes.data for res in third for a in res.values()}, "no memory was reused"


def test_blocked_callers_whose_first_cycle_misses_the_peer_still_complete():
    """Rank 0 blocks on "t" while rank 1's engine meets it in a cycle for another tensor: neither is
    ready. While a caller is blocked, cycles come every BURST_GAP x cycle_time (not cycle_time), so
    "t" completes soon after rank 1 submits it, and "other" once rank 0 does. (The speed itself is
    engine_bench's: a 4-byte round trip after a ResNet-50 step went from 1.3 ms to 0.1 ms.)"""
    cycle = 1000.0                                        # ms: the difference is 1 s against 0.2 s
    with engines(2, cycle_time=cycle) as engs:
        elapsed, results = [], {}

        def rank0():
            start = time.monotonic()
            results["t0"] = engs[0].submit(np.full(3, 1.0), name="t", op=Op.SUM).wait(30)
            elapsed.append(time.monotonic() - start)
            results["o0"] = engs[0].submit(np.full(2, 1.0), name="other", op=Op.SUM).wait(30)

        def rank1():
            time.sleep(0.05)
            other = engs[1].submit(np.full(2, 2.0), name="other", op=Op.SUM)
            with pytest.raises(TimeoutError):
                other.wait(0.01)                          # its cycle meets rank 0's: neither is ready
            time.sleep(0.05)
            results["t1"] = engs[1].submit(np.full(3, 2.0), name="t", op=Op.SUM).wait(30)
            results["o1"] = other.wait(30)

        threads = [threading.Thread(target=rank0), threading.Thread(target=rank1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["t0"].tolist() == results["t1"].tolist() == [3.0] * 3
        assert results["o0"].tolist() == results["o1"].tolist() == [3.0] * 2
        assert elapsed[0] < 2 * cycle / 1000.0, f"{elapsed[0]:.2f} s"


@pytest.mark.parametrize("algorithm", ["shm", "ring"])
def test_a_large_plain_tensor_is_reduced_from_the_callers_array_into_its_result(algorithm):
    """A plain tensor of DIRECT_BYTES or more goes alone: shm reads it where it is and writes only
    the result (no copy of the input first); other algorithms get it copied. Inputs stay intact."""
    from allreduce.engine.fusion import DIRECT_BYTES
    count = DIRECT_BYTES // 8 + 3
    with engines(3, algorithm=algorithm) as engs:
        xs = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(3)]
        handles = [e.submit(x, name="big", op=Op.SUM) for e, x in zip(engs, xs)]
        results = [h.wait(30) for h in handles]
    want = np.arange(count, dtype=np.float64) * 6
    for r in range(3):
        assert np.array_equal(results[r], want) and not np.shares_memory(results[r], xs[r])
        assert np.array_equal(xs[r], np.arange(count, dtype=np.float64) * (r + 1))
