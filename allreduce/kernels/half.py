"""Reduction kernels for the 16-bit floats, float16 and bfloat16.

numba cannot compute in either type, so these kernels work on the raw
``uint16`` bit patterns:

    decode:  bits -> float32      a 65536-entry table, exact by construction
    compute: float32 arithmetic   the same arithmetic numpy / ml_dtypes use
    encode:  float -> bits        round to nearest, ties to even, on the integer
                                  bit pattern (no frexp/rint: about 20x faster)

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


@njit(nogil=True, cache=True, inline="always")
def _encode(v, mant_bits, bias, overflow, nan_bits):
    """float -> 16-bit pattern, round to nearest, ties to even, in integer arithmetic only.

    ``v`` is widened to float64 (exact for float32), so one rounding happens:
    float64 -> 16 bits. ``overflow`` is implied by the rounding and kept for callers.
    """
    x = _bits_of(v)
    sign = (x >> 48) & 0x8000
    e = (x >> 52) & 0x7FF                     # float64 biased exponent
    m = x & 0xFFFFFFFFFFFFF                   # 52 stored mantissa bits
    inf_bits = (2 * bias + 1) << mant_bits
    if e == 0x7FF:
        return sign | (nan_bits if m != 0 else inf_bits)
    if e == 0:                                # zero or a float64 subnormal: far below any 16-bit value
        return sign
    drop = 52 - mant_bits                     # mantissa bits that do not fit
    exp = e - 1023 + bias                     # biased exponent in the 16-bit format
    full = m | (1 << 52)
    if exp <= 0:                              # a 16-bit subnormal: shift the hidden bit in too
        drop += 1 - exp
        if drop > 60:
            return sign                       # below half the smallest subnormal: rounds to zero
        r = full >> drop
    else:
        r = (exp << mant_bits) | (m >> drop)
    rest = full & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    if rest > half or (rest == half and (r & 1) == 1):
        r += 1                                # a carry may roll into the exponent: still correct
    if r >= inf_bits:
        r = inf_bits
    return sign | r


@njit(nogil=True, cache=True)
def reduce_half_into(dst, src, op, n, table, mant_bits, bias, overflow, nan_bits):
    """``dst = dst (op) src`` on uint16 bit patterns; ``n`` is the Average divisor."""
    for i in range(dst.size):
        a = table[dst[i]]
        b = table[src[i]]
        if op == _MIN:
            if b < a or b != b:
                dst[i] = src[i]
            continue
        if op == _MAX:
            if b > a or b != b:
                dst[i] = src[i]
            continue
        v = a * b if op == _PROD else a + b
        bits = _encode(v, mant_bits, bias, overflow, nan_bits)
        if op == _AVG:
            # Round the sum first, then the quotient: the same two roundings as sum-then-divide.
            bits = _encode(table[bits] / n, mant_bits, bias, overflow, nan_bits)
        dst[i] = bits


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
