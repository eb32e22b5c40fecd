"""Reduction kernels for the 16-bit floats, float16 and bfloat16.

numba cannot compute in either type, so these kernels work on the raw
``uint16`` bit patterns:

    decode:  bits -> float32      a 65536-entry table, exact by construction
    compute: float32 arithmetic   the same arithmetic numpy / ml_dtypes use
    encode:  float -> bits        round to nearest, ties to even, on the integer
                                  bit pattern, branch-free so loops vectorise

Decoding both inputs to float32, computing once and rounding once is exactly
what ``np.float16.__add__`` does, so results match numpy bit for bit
(tests/test_kernels.py checks every op against numpy).

The two formats differ only in field widths, passed as constants:

    format     mantissa bits  exponent bias  smallest normal  overflow from
    float16    10             15             2**-14           65520
    bfloat16   7              127            2**-126          (2 - 2**-8) * 2**127
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["HalfFormat", "FLOAT16", "BFLOAT16", "reduce_half_into", "avg_half_inplace",
           "encode_into", "decode_into"]


class HalfFormat:
    """Bit layout of one 16-bit float format plus its decode table."""

    def __init__(self, dtype, mant_bits: int, bias: int):
        self.dtype = np.dtype(dtype)
        self.mant_bits = mant_bits
        self.bias = bias
        self.table = np.arange(65536, dtype=np.uint16).view(self.dtype).astype(np.float32)
        self.max_finite = float(np.finfo(self.dtype).max)
        # Half-way between the largest finite value and 2**(emax+1): ties go to even (= inf).
        self.overflow = self.max_finite + 2.0 ** (np.finfo(self.dtype).maxexp - mant_bits - 2)
        self.nan_bits = int(np.array(np.nan, self.dtype).view(np.uint16)) & 0x7FFF
        self.args = (self.table, mant_bits, bias, self.overflow, self.nan_bits)


FLOAT16 = HalfFormat(np.float16, 10, 15)
BFLOAT16 = HalfFormat(ml_dtypes.bfloat16, 7, 127)

# Op codes for the kernels (kept local: numba wants plain ints, not the enum).
_SUM, _AVG, _MIN, _MAX, _PROD = 0, 1, 2, 3, 4


@intrinsic
def _bits_of(typingctx, x):
    """The IEEE-754 float64 bit pattern of ``x`` as an int64 (float32 is widened first, exactly)."""
    if x not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if signature.args[0] == types.float32:
            value = builder.fpext(value, ir.DoubleType())
        return builder.bitcast(value, ir.IntType(64))
    return types.int64(x), codegen


@intrinsic
def _float_of(typingctx, x):
    """The float64 whose IEEE-754 bit pattern is the int64 ``x``."""
    if x != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(x), codegen


@njit(nogil=True, cache=True, inline="always")
def _encode(v, mant_bits, bias, overflow, nan_bits):
    """float -> 16-bit pattern, round to nearest, ties to even, without a branch.

    ``v`` is widened to float64 (exact for float32), so one rounding happens:
    float64 -> 16 bits. Both candidate answers are computed and one is
    selected, so LLVM vectorises every loop that calls this (4 lanes of
    int64 with AVX2; a branchy version cost ~9 ns per element, this ~1):

    * normal: rebias the exponent in the integer pattern and round the
      ``52 - mant_bits`` dropped bits to nearest even (add half - 1, plus the
      lowest kept bit); a carry rolls into the exponent, which is correct,
      and past the largest finite value lands on (or beyond) infinity;
    * subnormal or zero: add the power of two whose float64 ulp is the
      smallest 16-bit subnormal; the FPU's own round-to-nearest-even then
      leaves the subnormal's bits in the low bits of the sum.

    ``overflow`` is implied by the rounding and kept for callers.
    """
    x = _bits_of(v)
    sign = (x >> 48) & 0x8000
    ax = x & 0x7FFFFFFFFFFFFFFF
    drop = 52 - mant_bits
    inf_bits = (2 * bias + 1) << mant_bits
    r = (ax - ((1023 - bias) << 52)) & 0x7FFFFFFFFFFFFFFF  # >= 0 wherever it is used: >> is then a
    r = (r + ((1 << (drop - 1)) - 1) + ((r >> drop) & 1)) >> drop   # logical shift, which AVX2 has
    magic = (1023 + 53 - bias - mant_bits) << 52          # 2**(53 - bias - mant_bits)
    sub = _bits_of(_float_of(ax) + _float_of(magic)) - magic
    r = sub if ax < ((1024 - bias) << 52) else r            # below the smallest normal, 2**(1 - bias)
    r = inf_bits if r > inf_bits else r
    r = nan_bits if ax > 0x7FF0000000000000 else r
    return sign | r


@intrinsic
def _f32_of(typingctx, x):
    """The float32 whose bit pattern is the low 32 bits of the int64 ``x``."""
    if x != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())
    return types.float32(x), codegen


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE-754 bit pattern of the float32 ``x`` as a (non-negative) int64."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))
    return types.int64(x), codegen


@njit(nogil=True, cache=True, inline="always")
def _decode(h, mant_bits, bias):
    """16-bit pattern -> float32, exactly, without a branch or a table (so loops vectorise).

    Shift the exponent and mantissa fields into float32's places and rebias
    the exponent; infinities and NaNs (exponent all ones) get the rebias
    twice, which makes float32's exponent all ones too, payload kept; zeros
    and subnormals are ``mantissa * 2**(1 - bias - mant_bits)``, exact in float64.
    """
    h = np.int64(h)
    mag = h & 0x7FFF
    rebias = (127 - bias) << 23
    o = (mag << (23 - mant_bits)) + rebias
    o = o + rebias if mag >= ((2 * bias + 1) << mant_bits) else o
    small = _f32_bits(np.float32(np.float64(mag) * _float_of((1023 + 1 - bias - mant_bits) << 52)))
    o = small if mag < (1 << mant_bits) else o
    return _f32_of(o | ((h & 0x8000) << 16))


@njit(nogil=True, cache=True)
def _sum_half(dst, src, table, mant_bits, bias, overflow, nan_bits):
    for i in range(dst.size):
        dst[i] = _encode(_decode(dst[i], mant_bits, bias) + _decode(src[i], mant_bits, bias),
                         mant_bits, bias, overflow, nan_bits)


@njit(nogil=True, cache=True)
def _prod_half(dst, src, table, mant_bits, bias, overflow, nan_bits):
    for i in range(dst.size):
        dst[i] = _encode(_decode(dst[i], mant_bits, bias) * _decode(src[i], mant_bits, bias),
                         mant_bits, bias, overflow, nan_bits)


@njit(nogil=True, cache=True)
def _min_half(dst, src, table):
    for i in range(dst.size):
        a = table[dst[i]]
        b = table[src[i]]
        dst[i] = src[i] if (b < a or b != b) else dst[i]


@njit(nogil=True, cache=True)
def _max_half(dst, src, table):
    for i in range(dst.size):
        a = table[dst[i]]
        b = table[src[i]]
        dst[i] = src[i] if (b > a or b != b) else dst[i]


@njit(nogil=True, cache=True)
def _sum_avg_half(dst, src, n, table, mant_bits, bias, overflow, nan_bits):
    for i in range(dst.size):
        # Round the sum first, then the quotient: the same two roundings as sum-then-divide.
        bits = _encode(table[dst[i]] + table[src[i]], mant_bits, bias, overflow, nan_bits)
        dst[i] = _encode(table[bits] / n, mant_bits, bias, overflow, nan_bits)


@intrinsic
def _f16_to_f32(typingctx, h):
    """float16 bits -> float32 with the CPU's conversion (F16C's vcvtph2ps on x86): exact."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen


@intrinsic
def _f32_to_f16(typingctx, x):
    """float32 -> float16 bits, round to nearest even, with the CPU's conversion (vcvtps2ph)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(x), codegen


@njit(nogil=True, cache=True, inline="always")
def _canonical_nan(bits, nan_bits):
    """Keep the sign, replace any NaN payload by ``nan_bits`` (what :func:`_encode` returns)."""
    b = np.int64(bits)
    return (b & 0x8000) | nan_bits if (b & 0x7FFF) > 0x7C00 else b


@njit(nogil=True, cache=True)
def _sum_f16(dst, src, nan_bits):
    for i in range(dst.size):
        dst[i] = _canonical_nan(_f32_to_f16(_f16_to_f32(dst[i]) + _f16_to_f32(src[i])), nan_bits)


@njit(nogil=True, cache=True)
def _prod_f16(dst, src, nan_bits):
    for i in range(dst.size):
        dst[i] = _canonical_nan(_f32_to_f16(_f16_to_f32(dst[i]) * _f16_to_f32(src[i])), nan_bits)


@njit(nogil=True, cache=True, inline="always")
def _bf16_of(v, nan_bits):
    """float32 -> bfloat16 bits, round to nearest even: bfloat16 is float32's top half, so this is
    one rounding of the low 16 bits (overflow carries into infinity, subnormals round alike)."""
    x = _f32_bits(v)
    r = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    return ((x >> 16) & 0x8000) | nan_bits if (x & 0x7FFFFFFF) > 0x7F800000 else r   # NaN: x's sign (a
    # payload can carry into r's sign bit, or past it)


@njit(nogil=True, cache=True, inline="always")
def _f32_of_bf16(h):
    return _f32_of(np.int64(h) << 16)


@njit(nogil=True, cache=True)
def _sum_bf16(dst, src, nan_bits):
    for i in range(dst.size):
        dst[i] = _bf16_of(_f32_of_bf16(dst[i]) + _f32_of_bf16(src[i]), nan_bits)


@njit(nogil=True, cache=True)
def _prod_bf16(dst, src, nan_bits):
    for i in range(dst.size):
        dst[i] = _bf16_of(_f32_of_bf16(dst[i]) * _f32_of_bf16(src[i]), nan_bits)


_FAST = {(10, _SUM): _sum_f16, (10, _PROD): _prod_f16, (7, _SUM): _sum_bf16, (7, _PROD): _prod_bf16}


def reduce_half_into(dst, src, op, n, table, mant_bits, bias, overflow, nan_bits):
    """``dst = dst (op) src`` on uint16 bit patterns; ``n`` is the Average divisor.

    One compiled loop per op (a loop with the op tested inside does not vectorise).
    Sum and Product of the two standard formats use the hardware float16
    conversions (F16C) or bfloat16's shift-and-round: about 10x the generic
    bit-pattern loop, and bitwise the same (tests/test_kernels.py).
    """
    fast = _FAST.get((mant_bits, op))
    if fast is not None and bias in (15, 127):
        fast(dst, src, nan_bits)
    elif op == _SUM:
        _sum_half(dst, src, table, mant_bits, bias, overflow, nan_bits)
    elif op == _AVG:
        _sum_avg_half(dst, src, n, table, mant_bits, bias, overflow, nan_bits)
    elif op == _PROD:
        _prod_half(dst, src, table, mant_bits, bias, overflow, nan_bits)
    elif op == _MIN:
        _min_half(dst, src, table)
    else:
        _max_half(dst, src, table)


@njit(nogil=True, cache=True)
def avg_half_inplace(dst, n, table, mant_bits, bias, overflow, nan_bits):
    for i in range(dst.size):
        dst[i] = _encode(table[dst[i]] / n, mant_bits, bias, overflow, nan_bits)


@njit(nogil=True, cache=True)
def encode_into(dst_bits, src, scale, mant_bits, bias, overflow, nan_bits):
    """Cast float32/float64 ``src * scale`` to 16-bit patterns in one pass (compression)."""
    for i in range(src.size):
        dst_bits[i] = _encode(src[i] * scale, mant_bits, bias, overflow, nan_bits)


@njit(nogil=True, cache=True)
def decode_into(dst, src_bits, scale, table):
    """Cast 16-bit patterns back to float32/float64, times ``scale``, in one pass."""
    for i in range(src_bits.size):
        dst[i] = table[src_bits[i]] * scale
