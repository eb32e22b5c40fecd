"""Shared-memory allreduce: the algorithm on thread ranks (exhaustive), race stress, errors, MPI."""
import functools
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from allreduce.algorithms import shm
from allreduce.buffers import Workspace
from allreduce.errors import PeerLostError, TransportError, TransportTimeoutError
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import SUPPORTED_DTYPES, Op
from allreduce.transport import shared
from allreduce.transport.threads import ThreadWorld, run_threads

from .harness import assert_allreduce_ok, make_inputs, mpirun, run_algorithm


def shm_with(slot_bytes):
    return functools.partial(shm.allreduce, slot_bytes=slot_bytes)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 100, 1001])
def test_edges_float32_sum(p, count):
    inputs = make_inputs(np.random.default_rng(count * 10 + p), p, count, np.float32, Op.SUM)
    # 16-byte windows: a 1001-element buffer streams through 251 windows, reusing both halves.
    assert_allreduce_ok(run_algorithm(shm_with(16), inputs, Op.SUM), inputs, Op.SUM)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(Op), ids=repr)
def test_every_dtype_and_op(dtype, op):
    for p in (2, 3):
        inputs = make_inputs(np.random.default_rng(p), p, 37, dtype, op)
        assert_allreduce_ok(run_algorithm(shm_with(24), inputs, op), inputs, op)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 6), count=st.integers(0, 3000), dtype=st.sampled_from(SUPPORTED_DTYPES),
       op=st.sampled_from(list(Op)), slot_bytes=st.sampled_from([8, 100, 4096, 1 << 20]))
def test_generated(p, count, dtype, op, slot_bytes):
    inputs = make_inputs(np.random.default_rng(count), p, count, dtype, op)
    assert_allreduce_ok(run_algorithm(shm_with(slot_bytes), inputs, op), inputs, op)


def stress(p, calls, fn, seed=0):
    """``calls`` back-to-back allreduces of random sizes on one world, every result checked exactly.

    Small integers make every summation order exact, so a result that read a
    half-written or already-overwritten window cannot pass by luck.
    """
    rng = np.random.default_rng(seed)
    plan = []
    for i in range(calls):
        count = int(rng.integers(0, 40)) if i % 8 else int(rng.integers(0, 1000))
        op = [Op.SUM, Op.MAX, Op.AVERAGE, Op.MIN][i % 4]
        dtype = [np.int32, np.float32, np.int8, np.float64][i % 4]
        xs = [rng.integers(-3, 4, count).astype(dtype) for _ in range(p)]
        plan.append((xs, op, allreduce_reference(xs, op)))

    def body(comm):
        workspace = Workspace()
        for i, (xs, op, want) in enumerate(plan):
            buf = xs[comm.rank].copy()
            fn(comm, buf, op, workspace=workspace, segment_bytes=64)
            if buf.tobytes() != want.tobytes():
                at = np.flatnonzero(buf.view(np.uint8) != want.view(np.uint8))[0] // buf.itemsize
                raise AssertionError(f"rank {comm.rank} call {i} ({buf.size} x {buf.dtype}, {op!r}): "
                                     f"element {at} is {buf[at]}, want {want[at]}")
    run_threads(p, body, timeout=60)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_stress_back_to_back_threads(p):
    stress(p, 1000, shm_with(64), seed=p)


def test_no_shared_memory_is_a_clear_error():
    class Pipe:
        rank, size = 0, 2
    with pytest.raises(ValueError, match="offers no shared memory"):
        shm.allreduce(Pipe(), np.ones(4, np.float32), Op.SUM, workspace=Workspace())


def test_slot_smaller_than_an_element():
    with pytest.raises(ValueError, match="smaller than one 8-byte element"):
        run_algorithm(shm_with(4), [np.ones(3), np.ones(3)], Op.SUM)


def test_a_rank_that_never_calls_times_out_and_segment_refuses_reuse():
    world = ThreadWorld(2, timeout=0.5)
    seen = {}

    def body(comm):
        if comm.rank == 1:
            return None                                   # never joins the collective
        buf = np.ones(10, np.float32)
        with pytest.raises((TransportTimeoutError, PeerLostError)) as info:
            shm.allreduce(comm, buf, Op.SUM, workspace=Workspace())
        seen["timeout"] = str(info.value)
        with pytest.raises(TransportError, match="unusable after an earlier failure"):
            shm.allreduce(comm, buf, Op.SUM, workspace=Workspace())
    run_threads(2, body, world=world, timeout=5)
    assert "waiting for rank 1" in seen["timeout"]


def test_segment_is_cached_on_the_transport():
    def body(comm):
        a = shared.attach(comm, 128)
        b = shared.attach(comm, 128)
        return a is b, a.regions[0] is not None
    assert run_threads(2, body) == [(True, True), (True, True)]


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_mpi_stress(np_):
    # 1000 calls of random sizes through 1 KiB windows (up to 80 per call), no barrier between calls.
    out = mpirun(np_, "shm_stress.py", "shm", "1000", "1024", timeout=240)
    assert out.stdout.count("shm allreduces OK") == np_


def test_mpi_public_api():
    out = mpirun(2, "api_check.py", "shm", timeout=240)
    assert out.returncode == 0


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 4, 1001])
@pytest.mark.parametrize("op", [Op.SUM, Op.AVERAGE, Op.MAX], ids=repr)
def test_out_of_place_reads_src_leaves_it_alone_and_matches_in_place(p, count, op):
    """src=: the input is read from src (never written), the result lands in buf, bit for bit what
    the in-place call gives; 16-byte windows so a long buffer streams through many."""
    dtype = np.float32 if op != Op.MAX else np.int32
    inputs = make_inputs(np.random.default_rng(count + p), p, count, dtype, op)
    in_place = run_algorithm(shm_with(16), inputs, op)

    def body(comm):
        src = inputs[comm.rank].copy().reshape(-1)
        before = src.copy()
        out = np.full_like(src, 99)
        shm.allreduce(comm, out, op, workspace=Workspace(), slot_bytes=16, src=src)
        assert src.tobytes() == before.tobytes(), "src was written"
        return out
    got = run_threads(p, body, timeout=20)
    for r in range(p):
        assert got[r].tobytes() == in_place[r].reshape(-1).tobytes()


def test_communicator_out_of_place_goes_through_src():
    """Communicator.allreduce (a new array) hands shm the input as src: non-contiguous inputs and
    0-d arrays too; the inputs stay as they were."""
    from allreduce.comm import Communicator
    from allreduce.config import Config
    for shape, strided in (((6, 4), True), ((), False), ((0, 3), False), ((1001,), False)):
        base = [np.arange(int(np.prod(shape)) * (4 if strided else 1), dtype=np.float64).reshape(
            tuple(n * 2 for n in shape) if strided else shape) + r for r in range(3)]
        xs = [b[::2, ::2] if strided else b for b in base]
        copies = [x.copy() for x in xs]

        def body(comm):
            c = Communicator(comm, config=Config(algorithm="shm"))
            return c.allreduce(xs[comm.rank], Op.SUM)
        got = run_threads(3, body, timeout=20)
        want = sum(copies)
        for r in range(3):
            assert got[r].shape == xs[r].shape and np.array_equal(got[r], want)
            assert np.array_equal(xs[r], copies[r])


# -- allreduce_many: several arrays streamed as one ------------------------------------------------

def _many(p, sizes, dtype, op, slot_bytes, out_of_place, seed=0):
    """Every rank reduces ``len(sizes)`` arrays with one allreduce_many; returns (inputs, results)."""
    rng = np.random.default_rng(seed)
    inputs = [make_inputs(rng, p, n, dtype, op) for n in sizes]     # inputs[i][rank]
    results = [None] * p

    def body(comm):
        xs = [inputs[i][comm.rank].copy() for i in range(len(sizes))]
        if out_of_place:
            bufs = [np.full_like(x, 99) for x in xs]
            shm.allreduce_many(comm, bufs, op, srcs=list(xs), slot_bytes=slot_bytes)
            for i, x in enumerate(xs):
                assert x.tobytes() == inputs[i][comm.rank].tobytes(), "the input changed"
        else:
            bufs = xs
            shm.allreduce_many(comm, bufs, op, slot_bytes=slot_bytes)
        results[comm.rank] = bufs
    run_threads(p, body, timeout=60)
    return inputs, results


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("out_of_place", [False, True], ids=["inplace", "outofplace"])
def test_many_matches_one_call_on_the_joined_arrays(p, out_of_place):
    # 40-byte windows: windows straddle array boundaries; empty arrays and a 1-element one between.
    sizes = [7, 0, 1, 33, 10, 0, 64]
    for dtype, op in ((np.float32, Op.AVERAGE), (np.int32, Op.SUM), (np.float64, Op.MAX), (np.float16, Op.SUM)):
        inputs, results = _many(p, sizes, dtype, op, 40, out_of_place, seed=p)
        joined = [np.concatenate([inputs[i][r] for i in range(len(sizes))]) for r in range(p)]
        want = run_algorithm(functools.partial(shm.allreduce, slot_bytes=40), joined, op)[0]
        for r in range(p):
            got = np.concatenate(results[r])
            assert got.tobytes() == want.tobytes(), f"rank {r} {np.dtype(dtype)} {op!r}: not bitwise the joined call"
        assert_allreduce_ok([np.concatenate(results[r]) for r in range(p)], joined, op)


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 4), sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       slot_bytes=st.sampled_from([8, 100, 4096]), out_of_place=st.booleans())
def test_many_generated(p, sizes, slot_bytes, out_of_place):
    inputs, results = _many(p, sizes, np.int64, Op.SUM, slot_bytes, out_of_place)
    for i in range(len(sizes)):
        want = allreduce_reference([inputs[i][r] for r in range(p)], Op.SUM)
        for r in range(p):
            assert results[r][i].tobytes() == want.tobytes(), f"array {i} rank {r}"


def test_many_rejects_mixed_dtypes():
    def body(comm):
        with pytest.raises(ValueError, match="1-D float32"):
            shm.allreduce_many(comm, [np.ones(3, np.float32), np.ones(3, np.float64)], Op.SUM)
    run_threads(2, body, timeout=30)


def test_default_window_follows_oversubscription(monkeypatch):
    """2 MiB windows while every rank of the node has a core, 4 MiB beyond (shared.window_bytes),
    the same on every rank; the default call streams through them and select counts them."""
    from allreduce.algorithms import select
    assert shared.window_bytes(2, cores=2) == shared.WINDOW_BYTES == 2 << 20
    assert shared.window_bytes(3, cores=2) == shared.WINDOW_BYTES_OVERSUBSCRIBED == 4 << 20
    assert shared.window_bytes(4, cores=None) == shared.window_bytes(4, cores=os.cpu_count())
    monkeypatch.setattr(shared, "_CORES", 2)
    assert select.terms("shm", 2, 16 << 20)[0] == 2 * 8       # two syncs per 2 MiB window
    assert select.terms("shm", 4, 16 << 20)[0] == 2 * 4       # ... per 4 MiB window
    seen = []
    real = shm.windows
    monkeypatch.setattr(shm, "windows", lambda count, itemsize, slot: seen.append(slot) or real(count, itemsize, slot))
    inputs = make_inputs(np.random.default_rng(5), 2, 1000, np.float32, Op.SUM)
    assert_allreduce_ok(run_algorithm(shm.allreduce, inputs, Op.SUM), inputs, Op.SUM)
    assert seen == [2 << 20] * 2


def test_traffic_counts_the_bytes_each_step_moves():
    """shm.traffic: copy-in 2(p-1)/p, reduce in passes of up to three peers (each pass reads the
    slice and its peers' copies and writes it once), publish 1/p, copy-out 2(p-1)/p; registered
    buffers only reduce and push (p-1)/p. The figures the docs and the benchmark's notes quote."""
    assert shm.traffic(1) == 0.0
    assert shm.traffic(2) == pytest.approx(4.0)          # 1 + 1.5 + 0.5 + 1
    assert shm.traffic(3) == pytest.approx(5.0)          # two pairwise passes: 6/3
    assert shm.traffic(4) == pytest.approx(4.5)          # one pass of three peers: 5/4
    assert shm.traffic(5) == pytest.approx(5.0)          # a pass of three and a pairwise one: 8/5
    assert [shm.traffic(p, registered=True) for p in (2, 4)] == pytest.approx([2.0, 2.0])
    for p in range(2, 12):                               # never below the floor: read n, write n
        assert shm.traffic(p, registered=True) >= 2.0 and shm.traffic(p) > shm.traffic(p, registered=True)
