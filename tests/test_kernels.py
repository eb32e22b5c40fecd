"""The reduction kernels against numpy, bit for bit, including the 16-bit float encoder."""
import ml_dtypes
import numpy as np
import pytest

from allreduce import kernels
from allreduce.kernels import half
from allreduce.kernels.reference import reduce_pair
from allreduce.ops import SUPPORTED_DTYPES, Op

SPECIAL = np.array([0, -0.0, np.inf, -np.inf, np.nan, 65504, -65504, 65519.99, 65520, 6e-8, 2.98e-8,
                    2.9802322e-08, 1e-5, 3.0e38, -3.0e38, 1e-40, 6.1035156e-05, 6.1e-5, 1.0, -1.0], np.float32)


# The dtypes the numba kernels take directly (the 16-bit floats go through half.py).
NATIVE = [np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.uint16, np.int16, np.bool_]


# Every dtype with every op, but Average of bool (check_dtype refuses it before any kernel runs).
DTYPE_OPS = [(d, op) for d in SUPPORTED_DTYPES for op in Op if not (d.kind == "b" and op == Op.AVERAGE)]


def _inputs(dtype, n=20000, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        ends = np.array([False, True, True, False])
        return (np.concatenate([rng.integers(0, 2, n).astype(bool), ends]),
                np.concatenate([rng.integers(0, 2, n).astype(bool), ends[::-1]]))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        ends = np.array([info.min, info.max, 0, 1, -1 if info.min < 0 else 2], dtype=dtype)
        a = np.concatenate([rng.integers(info.min, info.max, n, endpoint=True).astype(dtype), ends, ends[::-1]])
        b = np.concatenate([rng.integers(info.min, info.max, n, endpoint=True).astype(dtype), ends[::-1], ends])
        return a, b
    wide = rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n)
    a = np.concatenate([wide, SPECIAL, SPECIAL[::-1]]).astype(dtype)
    b = np.concatenate([rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n), SPECIAL[::-1], SPECIAL]).astype(dtype)
    return a, b


def _same(got, want):
    if got.dtype.kind in "iub":
        return np.array_equal(got, want)
    g, w = got.astype(np.float64), want.astype(np.float64)
    both_nan = np.isnan(g) & np.isnan(w)
    bits = got.view(f"u{got.itemsize}") == want.view(f"u{want.itemsize}")
    return bool(np.all(bits | both_nan))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", [Op.SUM, Op.PRODUCT, Op.MIN, Op.MAX], ids=repr)
def test_reduce_into_matches_numpy_bitwise(dtype, op):
    a, b = _inputs(dtype)
    got = a.copy()
    with np.errstate(all="ignore"):
        kernels.reduce_into(got, b, op)
        want = reduce_pair(a, b, op)
    assert _same(got, want)


@pytest.mark.parametrize("dtype", [d for d in SUPPORTED_DTYPES if d.kind != "b"], ids=str)   # bool: no Average
@pytest.mark.parametrize("nranks", [1, 3, 8])
def test_fused_average_is_sum_then_divide(dtype, nranks):
    a, b = _inputs(dtype, n=5000, seed=nranks)
    got = a.copy()
    kernels.reduce_finish_into(got, b, Op.AVERAGE, nranks)
    with np.errstate(all="ignore"):
        total = reduce_pair(a, b, Op.SUM)
        if np.dtype(dtype).kind in "iu":       # NCCL's ncclAvg: wrapped sum, divide toward zero
            q = np.abs(total.astype(np.int64)) // nranks
            want = np.where(total >= 0, q, -q).astype(dtype)
        elif np.dtype(dtype).itemsize == 2:    # both roundings of the 16-bit formats
            want = (total.astype(np.float32).astype(np.float64) / nranks).astype(dtype)
        else:
            want = (total / np.array(nranks, dtype)).astype(dtype) if dtype == np.float32 \
                else (total / nranks).astype(dtype)
    assert _same(got, want)


@pytest.mark.parametrize("fmt,dtype", [(half.FLOAT16, np.float16), (half.BFLOAT16, ml_dtypes.bfloat16)], ids=["f16", "bf16"])
def test_encode_from_float32_matches_numpy_cast(fmt, dtype):
    rng = np.random.default_rng(5)
    v = np.concatenate([(rng.standard_normal(200000) * 10.0 ** rng.integers(-12, 8, 200000)), SPECIAL]).astype(np.float32)
    # Every float32 tie point between two adjacent 16-bit values, too.
    edges = np.arange(0, 65535, 7, dtype=np.uint16).view(dtype).astype(np.float32)
    v = np.concatenate([v, edges, np.nextafter(edges, np.float32(np.inf))])
    out = np.empty(v.size, np.uint16)
    half.encode_into(out, v, np.float32(1.0), *fmt.args[1:])
    with np.errstate(all="ignore"):
        want = v.astype(dtype).view(np.uint16)
    assert np.all((out == want) | np.isnan(v))


def test_encode_float64_rounds_once():
    rng = np.random.default_rng(6)
    v = rng.standard_normal(200000) * 10.0 ** rng.integers(-12, 8, 200000)
    out = np.empty(v.size, np.uint16)
    half.encode_into(out, v, 1.0, *half.FLOAT16.args[1:])
    with np.errstate(all="ignore"):
        assert np.array_equal(out, v.astype(np.float16).view(np.uint16))   # numpy casts float64 directly


def test_decode_is_exact():
    bits = np.arange(65536, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    half.decode_into(out, bits, np.float32(1.0), half.FLOAT16.table)
    ref = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(out, ref, equal_nan=True)


def test_empty_and_finish_noop():
    x = np.empty(0, np.float32)
    kernels.reduce_into(x, x, Op.SUM)
    y = np.arange(4.0)
    kernels.finish(y, Op.SUM, 4)
    assert np.array_equal(y, np.arange(4.0))
    kernels.finish(y, Op.AVERAGE, 2)
    assert np.array_equal(y, np.arange(4.0) / 2)


@pytest.mark.parametrize("fmt", [half.FLOAT16, half.BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("code", [0, 4], ids=["sum", "prod"])
def test_fast_half_kernels_match_generic_bit_kernel(fmt, code):
    """The hardware-conversion (F16C) / shift-and-round Sum and Product loops give exactly the
    generic bit-pattern loop's bits for every 16-bit pattern (inf, subnormal, overflow, NaN as
    the canonical NaN), against itself, its negation and shuffled partners. The one freedom: the
    sign of NaN (op) NaN, which depends on the operand order the compiler picks for a vector add."""
    every = np.arange(65536, dtype=np.uint16)
    rng = np.random.default_rng(7)
    generic = half._sum_half if code == 0 else half._prod_half
    fast = half._FAST[(fmt.mant_bits, code)]
    for partner in (every, every ^ np.uint16(0x8000), rng.permutation(every), rng.permutation(every)):
        want, got = every.copy(), every.copy()
        generic(want, partner, *fmt.args)
        fast(got, partner, fmt.nan_bits)
        inf_bits = (2 * fmt.bias + 1) << fmt.mant_bits
        both_nan = ((every & 0x7FFF) > inf_bits) & ((partner & 0x7FFF) > inf_bits)
        assert np.array_equal(got[~both_nan], want[~both_nan])
        assert np.array_equal(got[both_nan] & 0x7FFF, want[both_nan] & 0x7FFF)


@pytest.mark.parametrize("fmt", [half.FLOAT16, half.BFLOAT16], ids=["f16", "bf16"])
def test_branch_free_decode_matches_table(fmt):
    from numba import njit

    @njit
    def decode_all(out, bits, mant_bits, bias):
        for i in range(bits.size):
            out[i] = half._decode(bits[i], mant_bits, bias)

    out = np.empty(65536, np.float32)
    decode_all(out, np.arange(65536, dtype=np.uint16), fmt.mant_bits, fmt.bias)
    assert np.array_equal(out.view(np.uint32), fmt.table.view(np.uint32))


@pytest.mark.parametrize("dtype", NATIVE)
@pytest.mark.parametrize("op", [Op.SUM, Op.PRODUCT])
def test_reduce_first_into_puts_src_first(dtype, op):
    """``dst = src (op) dst`` for recursive doubling's higher rank: the same values as numpy
    with the operands in that order; Min/Max and 16-bit floats decline (the caller falls back)."""
    from allreduce import kernels
    rng = np.random.default_rng(5)
    src = rng.integers(0, 7, 1001).astype(dtype)
    dst = rng.integers(0, 7, 1001).astype(dtype)
    want = (np.add if op == Op.SUM else np.multiply)(src, dst)
    assert kernels.reduce_first_into(dst, src, op)
    np.testing.assert_array_equal(dst, want)
    assert not kernels.reduce_first_into(dst, src, Op.MIN)
    assert not kernels.reduce_first_into(dst.astype(np.float16), src.astype(np.float16), op)


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("dtype", NATIVE)
def test_reduce_finish_into_both_writes_the_same_result_twice(op, dtype):
    """shm's one-pass publish: dst and out both get exactly what reduce_finish_into gives dst."""
    rng = np.random.default_rng(7)
    if np.dtype(dtype).kind == "f":
        a = rng.standard_normal(1001).astype(dtype)
        b = rng.standard_normal(1001).astype(dtype)
        a[:4] = [np.inf, -0.0, 0.0, 1.0]
        b[:4] = [1.0, 0.0, -0.0, np.nan]
    elif np.dtype(dtype).kind == "b":
        a, b = (rng.integers(0, 2, 1001).astype(bool) for _ in range(2))
    else:
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, 1001, endpoint=True).astype(dtype)
        b = rng.integers(info.min, info.max, 1001, endpoint=True).astype(dtype)
    want = a.copy()
    kernels.reduce_finish_into(want, b, op, 3)
    dst, out = a.copy(), np.full_like(a, 7)
    assert kernels.reduce_finish_into_both(dst, b, out, op, 3)
    assert dst.tobytes() == want.tobytes() and out.tobytes() == want.tobytes()
    empty = np.empty(0, dtype)
    assert kernels.reduce_finish_into_both(empty, empty, empty, op, 3)


def test_reduce_finish_into_both_declines_the_16_bit_formats():
    x = np.ones(4, np.float16)
    assert not kernels.reduce_finish_into_both(x, x.copy(), x.copy(), Op.SUM, 2)


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("dtype", NATIVE)
@pytest.mark.parametrize("lo, hi", [(0, 501), (500, 1001), (0, 1001), (3, 3), (0, 0)])
def test_reduce_finish_split_into_keeps_each_pieces_operand_order(op, dtype, lo, hi):
    """tree's p = 2 finish: dst first on [lo, hi), src first elsewhere, bit for bit as two calls.
    NaNs with different payloads and signed zeros sit on both sides of every split."""
    rng = np.random.default_rng(11)
    if np.dtype(dtype).kind == "f":
        a = rng.standard_normal(1001).astype(dtype)
        b = rng.standard_normal(1001).astype(dtype)
        nan1 = np.frombuffer(np.array([0x7FC00001], np.uint32).tobytes(), np.float32)[0].astype(dtype)
        nan2 = -np.abs(nan1)
        for at in (0, 499, 500, 501, 1000):
            a[at:at + 1], b[at:at + 1] = (nan1, nan2) if at % 2 else (-0.0, 0.0)
        a[2], b[2] = np.nan, 1.0
    elif np.dtype(dtype).kind == "b":
        a, b = (rng.integers(0, 2, 1001).astype(bool) for _ in range(2))
    else:
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, 1001, endpoint=True).astype(dtype)
        b = rng.integers(info.min, info.max, 1001, endpoint=True).astype(dtype)
    want = a.copy()
    kernels.reduce_finish_into(want[lo:hi], b[lo:hi], op, 2)                 # dst first
    for piece in (slice(0, lo), slice(hi, None)):                            # src first
        first = b[piece].copy()
        kernels.reduce_finish_into(first, a[piece], op, 2)
        want[piece] = first
    got = a.copy()
    assert kernels.reduce_finish_split_into(got, b, lo, hi, op, 2)
    assert got.tobytes() == want.tobytes()


def test_reduce_finish_split_into_declines_the_16_bit_formats():
    x = np.ones(4, np.float16)
    assert not kernels.reduce_finish_split_into(x, x.copy(), 0, 2, Op.SUM, 2)


def _pairwise_many(dst, srcs, op, nranks):
    """The reference for reduce_many_into: one pairwise call per source, the last finishing."""
    if op == Op.AVERAGE and nranks == 0:
        op = Op.SUM
    if not srcs:
        kernels.finish(dst, op, max(nranks, 1))
    for i, src in enumerate(srcs):
        if i < len(srcs) - 1:
            kernels.reduce_into(dst, src, op)
        else:
            kernels.reduce_finish_into(dst, src, op, max(nranks, 1))


@pytest.mark.parametrize("dtype, op", DTYPE_OPS, ids=str)
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 6, 7])
def test_reduce_many_into_gives_the_bits_of_pairwise_calls(dtype, op, k):
    """shm's reduce step: k peers' copies in one call (three per pass for native dtypes), exactly
    what k pairwise calls in the same order give, with and without a second output."""
    rng = np.random.default_rng(k)
    a, b = _inputs(dtype, n=3000, seed=k)
    pool = [a, b, a[::-1].copy(), b[::-1].copy(), np.roll(a, 7), np.roll(b, 11), np.roll(a, 13), np.roll(b, 5)]
    for nranks in (0, k + 1):
        dst0 = pool[k].copy()
        rng.shuffle(dst0)
        srcs = [pool[j] for j in range(k)]
        want = dst0.copy()
        with np.errstate(all="ignore"):
            _pairwise_many(want, srcs, op, nranks)
            got, out = dst0.copy(), np.zeros_like(dst0)
            kernels.reduce_many_into(got, srcs, op, nranks, out=out)
            alone = dst0.copy()
            kernels.reduce_many_into(alone, srcs, op, nranks)
        assert _same(got, want) and _same(out, want) and _same(alone, want)
    empty = np.empty(0, dtype)
    kernels.reduce_many_into(empty, [empty] * k, op, 2, out=empty)


def test_reduce_many_into_int64_sums_stay_exact():
    """Integer sums run in int64 and are never rounded through float64 (values past 2**53)."""
    big = np.array([2**62 + 1, -(2**62) - 3, 2**53 + 1], np.int64)
    dst = big.copy()
    kernels.reduce_many_into(dst, [big, big, big], Op.SUM, 0)
    np.testing.assert_array_equal(dst, big * 4)
    dst = big.copy()
    kernels.reduce_many_into(dst, [big, big, big], Op.AVERAGE, 4)
    want = big * 4
    np.testing.assert_array_equal(dst, np.where(want >= 0, np.abs(want) // 4, -(np.abs(want) // 4)))


@pytest.mark.parametrize("dtype, op", DTYPE_OPS, ids=str)
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7])
def test_reduce_push_into_leaves_the_same_bits_in_every_operand(dtype, op, k):
    """shm on registered buffers: my slice and every peer's copy of it end with exactly what k
    pairwise calls give my slice (fused loops for one and three peers, chunks otherwise)."""
    a, b = _inputs(dtype, n=3000, seed=k + 10)
    pool = [a, b, a[::-1].copy(), b[::-1].copy(), np.roll(a, 7), np.roll(b, 11), np.roll(a, 13), np.roll(b, 5)]
    for nranks in (0, k + 1):
        want = pool[k].copy()
        srcs = [pool[j].copy() for j in range(k)]
        with np.errstate(all="ignore"):
            _pairwise_many(want, [s.copy() for s in srcs], op, nranks)
            got = pool[k].copy()
            kernels.reduce_push_into(got, srcs, op, nranks)
        assert _same(got, want)
        assert all(_same(s, want) for s in srcs)
    empty = np.empty(0, dtype)
    kernels.reduce_push_into(empty, [empty] * k, op, 2)


def test_reduce_push_into_chunks_cover_the_whole_slice(monkeypatch):
    """The fallback (two peers here) works chunk by chunk; a chunk boundary inside the slice changes
    nothing."""
    monkeypatch.setattr(kernels, "PUSH_CHUNK_BYTES", 40)       # 10 float32 per chunk
    rng = np.random.default_rng(3)
    x, y, z = (rng.standard_normal(97).astype(np.float32) for _ in range(3))
    want = x.copy()
    _pairwise_many(want, [y, z], Op.AVERAGE, 3)
    ys, zs = y.copy(), z.copy()
    kernels.reduce_push_into(x, [ys, zs], Op.AVERAGE, 3)
    assert x.tobytes() == want.tobytes() == ys.tobytes() == zs.tobytes()
