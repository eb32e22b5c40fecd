"""Buffers: ResultPool reuses result memory once the caller has let go of it (never while it has not); Pieces."""
import numpy as np
import pytest

from allreduce.buffers import ResultPool


def test_a_dropped_result_is_reused_and_a_held_one_never_is():
    pool = ResultPool(min_bytes=64, keep=4)
    a = pool.empty(100, np.float32)
    where = a.ctypes.data
    del a
    b = pool.empty(100, np.float32)
    assert b.ctypes.data == where and pool.reused == 1
    del b
    # Anything made from a result keeps its memory out of reach: a reshape, a slice, a memoryview.
    for hold in (lambda x: x.reshape(10, 10), lambda x: x[3:7], memoryview):
        b = pool.empty(100, np.float32)
        kept = hold(b)
        where = b.ctypes.data
        del b
        c = pool.empty(100, np.float32)
        assert not np.shares_memory(c, np.asarray(kept)), "a block still in use was handed out again"
        del c, kept
        d = pool.empty(100, np.float32)                      # both free again: one is reused
        assert pool.allocated <= 4
        del d
    assert where in {pool.empty(100, np.float32).ctypes.data, pool.empty(100, np.float32).ctypes.data}


def test_pooled_results_are_64_byte_aligned_and_still_tracked():
    """TensorFlow shares a numpy array's memory only when it is 64-byte aligned (else tfops' eager
    results were copied); the aligned view must still count as a use of its block."""
    pool = ResultPool(min_bytes=64, keep=4)
    held = [pool.empty(n, dt) for n, dt in ((100, np.float32), (1000, np.float64), (333, np.int8))]
    assert all(a.ctypes.data % 64 == 0 for a in held)
    again = pool.empty(100, np.float32)                       # the first is held: a new block
    assert not np.shares_memory(again, held[0]) and again.ctypes.data % 64 == 0


def test_other_dtypes_small_arrays_and_bounds():
    pool = ResultPool(min_bytes=1024, keep=2, max_bytes=4096)
    small = pool.empty(10, np.float64)                       # 80 B: not pooled
    assert small.nbytes == 80 and pool.allocated == 0
    a = pool.empty(256, np.int32)
    assert a.dtype == np.int32 and a.shape == (256,)
    held = [pool.empty(256, np.int32) for _ in range(3)]     # all in use: beyond keep the pool forgets
    assert pool.nbytes <= 2 * 1024
    del a, held
    x = pool.empty(512, np.float64)                          # 4 KiB: over max_bytes, unused blocks dropped
    assert pool.nbytes <= 4096 + 1024 and x.nbytes == 4096
    pool.clear()
    assert pool.nbytes == 0


def test_communicator_results_are_recycled_only_when_dropped():
    """ar.allreduce's new arrays come from the communicator's pool: a held result is never
    reused, a dropped one is."""
    from allreduce.comm import Communicator
    from allreduce.ops import Op
    from allreduce.transport.threads import run_threads

    def body(comm):
        c = Communicator(comm)
        x = np.full(100_000, comm.rank + 1.0)                 # 800 KB: pooled
        first = c.allreduce(x, Op.SUM)
        second = c.allreduce(x * 10, Op.SUM)
        assert not np.shares_memory(first, second)
        assert first[0] == 3.0 and second[0] == 30.0         # the held result is intact
        where = second.ctypes.data
        del second
        third = c.allreduce(x * 100, Op.SUM)
        assert third[0] == 300.0 and first[-1] == 3.0
        return third.ctypes.data == where
    assert all(run_threads(2, body, timeout=30))


def test_pieces_parts_and_slices():
    from allreduce.buffers import Pieces, parts
    arrays = [np.arange(0, 3), np.arange(3, 5), np.arange(5, 5), np.arange(5, 9)]
    pieces = Pieces(arrays)
    assert pieces.size == 9
    got = [(pos, v.tolist()) for pos, v in pieces.parts(2, 6)]
    assert got == [(0, [2]), (1, [3, 4]), (3, [5])]
    assert pieces.parts(9, 9) == []
    window = pieces[4:8]
    assert window.size == 4 and np.concatenate(window.arrays).tolist() == [4, 5, 6, 7]
    window.arrays[0][0] = -1                     # views: writes reach the original arrays
    assert arrays[1][1] == -1
    plain = np.arange(10)
    assert [(p, v.tolist()) for p, v in parts(plain, 3, 5)] == [(0, [3, 4])]
    with pytest.raises(ValueError, match="1-D"):
        Pieces([np.ones(2), np.ones((2, 2))])


def test_many_results_of_one_size_in_use_at_once_are_all_recycled():
    # A model has many gradients of one shape, all held within a step; every one of them must be
    # reused next step (with keep=4, the pool forgot all but the last few every step).
    pool = ResultPool(min_bytes=64)
    first = [pool.empty(1000, np.float32) for _ in range(11)]
    addresses = {a.ctypes.data for a in first}
    del first
    again = [pool.empty(1000, np.float32) for _ in range(11)]
    assert {a.ctypes.data for a in again} == addresses and pool.allocated == 11 and pool.reused == 11
