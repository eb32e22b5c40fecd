"""Reduction kernels for the 16-bit floats, float16 and bfloat16.

numba cannot compute in either type, so these kernels work on the raw
``uint16`` bit patterns:

    decode:  bits -> float32      a 65536-entry table, exact by construction
    compute: float32 arithmetic   the same arithmetic numpy / ml_dtypes use
    encode:  float32 -> bits      round to nearest, ties to even

Decoding both inputs to float32, computing once and rounding once is exactly
what ``np.float16.__add__`` does, so results match numpy bit for bit
(tests/test_kernels.py checks every op against numpy).

The two formats differ only in field widths, passed as constants:

    format     mantissa bits  exponent bias  smallest normal  overflow from
    float16    10             15             2**-14           65520
    bfloat16   7              127            2**-126          (2 - 2**-8) * 2**127
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from numba import njit

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


@njit(nogil=True, cache=True, inline="always")
def _encode(v, mant_bits, bias, overflow, nan_bits):
    """float -> 16-bit pattern, round to nearest even."""
    sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
    if v != v:
        return sign | nan_bits
    a = abs(v)
    if a >= overflow:
        return sign | ((2 * bias + 1) << mant_bits)        # infinity
    min_normal = 2.0 ** (1 - bias)
    if a < min_normal:                                     # subnormal (or zero)
        m = int(np.rint(a * 2.0 ** (bias - 1 + mant_bits)))
        return sign | m                                    # m == 2**mant_bits is the smallest normal
    frac, e = math.frexp(a)                                # a = frac * 2**e, frac in [0.5, 1)
    m = int(np.rint(frac * 2.0 ** (mant_bits + 1)))
    exp = e - 1 + bias
    if m == 1 << (mant_bits + 1):                          # rounding carried into the exponent
        m >>= 1
        exp += 1
    return sign | (exp << mant_bits) | (m - (1 << mant_bits))


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
