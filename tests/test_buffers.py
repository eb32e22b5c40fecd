"""ResultPool: result memory is reused once the caller has let go of it, and never while it has not."""
import numpy as np

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
