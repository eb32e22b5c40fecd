"""The fused fp16/bf16 casts of :class:`~allreduce.engine.compression.HalfCompressor`, as numba loops.

Each loop writes 16-bit patterns straight into the fusion buffer (or decodes
them out of it), multiplies by a scale on the way, and counts values that
became non-finite, in one pass: compression.py's docstring says why, and
:meth:`HalfCompressor.encode_into` which loop runs when.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..kernels import half
from ..kernels.half import _encode

__all__ = ["_encode_checked", "_encode_feedback", "_decode_checked", "_encode_f32_fast", "_encode_f16_any",
           "_encode_bf16_any", "_decode_f16_any", "_decode_bf16_any", "_count_nonfinite_bits"]


@njit(nogil=True, cache=True, inline="always")
def _tally(v, b, inf_bits):
    """``(became inf/NaN, was inf/NaN)`` for input ``v`` encoded as ``b``, as 0/1 without a branch."""
    was = np.int64(v - v != 0.0)                       # inf - inf and NaN - NaN are NaN
    return (1 - was) * np.int64((b & 0x7FFF) >= inf_bits), was


@njit(nogil=True, cache=True)
def _encode_checked(dst_bits, src, scale, mant_bits, bias, overflow, nan_bits):
    """dst = bits(src * scale); return (finite inputs that became inf/NaN, non-finite inputs)."""
    bad = 0
    nonfinite = 0
    inf_bits = (2 * bias + 1) << mant_bits
    for i in range(src.size):
        v = src[i] * scale
        b = _encode(v, mant_bits, bias, overflow, nan_bits)
        dst_bits[i] = b
        became, was = _tally(v, b, inf_bits)
        bad += became
        nonfinite += was
    return bad, nonfinite


@njit(nogil=True, cache=True)
def _encode_feedback(dst_bits, src, residual, scale, table, mant_bits, bias, overflow, nan_bits):
    """As _encode_checked on src + residual; residual becomes what the rounding lost."""
    bad = 0
    nonfinite = 0
    inf_bits = (2 * bias + 1) << mant_bits
    for i in range(src.size):
        v = src[i] + residual[i]
        b = _encode(v * scale, mant_bits, bias, overflow, nan_bits)
        dst_bits[i] = b
        residual[i] = v - table[b] / scale
        became, was = _tally(v, b, inf_bits)
        bad += became
        nonfinite += was
    return bad, nonfinite


@njit(nogil=True, cache=True)
def _decode_checked(dst, src_bits, scale, table):
    """dst = float(src_bits) * scale; return how many results are inf or NaN."""
    nonfinite = 0
    for i in range(src_bits.size):
        v = table[src_bits[i]] * scale
        dst[i] = v
        if not math.isfinite(v):
            nonfinite += 1
    return nonfinite


@njit(nogil=True, cache=True)
def _encode_f32_fast(dst_bits, src, scale, f16, nan_bits):
    """float32 ``src * scale`` -> float16 (F16C's vcvtps2ph) or bfloat16 bits; counts as _encode_checked.

    Only for a power-of-two ``scale`` (float32): the product is then exact in
    float32 (below float32's smallest normal, ~1e-38, it may round first,
    which can move a bfloat16 result there by one unit in its last place).
    """
    bad = 0
    nonfinite = 0
    inf_bits = 0x7C00 if f16 else 0x7F80
    for i in range(src.size):
        v = src[i] * scale
        b = half._canonical_nan(half._f32_to_f16(v), nan_bits) if f16 else half._bf16_of(v, nan_bits)
        dst_bits[i] = b
        became, was = _tally(v, b, inf_bits)
        bad += became
        nonfinite += was
    return bad, nonfinite


# The any-kernels: the cast and a branch-free OR of "inf or NaN", one loop per format, nothing
# else in it, so LLVM vectorises it. fp16: 16 MiB of float32 took 0.9-1.1 ms against 2.6-14 ms for
# the counting loop (_encode_f32_fast) on the loaded 2-core VM (by hand), the bare cast 0.85 ms; a
# loop that also tested the format, made NaNs canonical or counted did not vectorise. A call with
# an inf or NaN in it (rare) pays a second, exact pass for the counts and the canonical NaNs.


@njit(nogil=True, cache=True)
def _encode_f16_any(dst_bits, src, scale):
    """float32 ``src * scale`` -> float16 bits (F16C's vcvtps2ph); return nonzero if some result
    is inf/NaN. Then the caller redoes the pass with :func:`_encode_f32_fast`, which also makes
    NaNs canonical and counts; where this returns 0 there is no NaN to make canonical, and no
    input was inf/NaN either (those stay inf/NaN), so the counts are (0, 0)."""
    seen = np.uint32(0)
    for i in range(src.size):
        b = np.uint32(half._f32_to_f16(src[i] * scale))
        dst_bits[i] = b
        seen |= np.uint32((b & 0x7FFF) >= 0x7C00)
    return seen


@njit(nogil=True, cache=True)
def _encode_bf16_any(dst_bits, src, scale, nan_bits):
    """:func:`_encode_f16_any` for bfloat16 (:func:`~allreduce.kernels.half._bf16_of`'s rounding,
    which makes NaNs canonical itself)."""
    seen = np.uint32(0)
    for i in range(src.size):
        b = np.uint32(half._bf16_of(src[i] * scale, nan_bits))
        dst_bits[i] = b
        seen |= np.uint32((b & 0x7FFF) >= 0x7F80)
    return seen


@njit(nogil=True, cache=True)
def _decode_f16_any(dst, src_bits):
    """float16 bits -> float32 (F16C); return nonzero if some value is inf/NaN (the count, where
    one is needed, is :meth:`HalfCompressor.count_nonfinite`'s second pass)."""
    seen = np.uint32(0)
    for i in range(src_bits.size):
        b = src_bits[i]
        dst[i] = half._f16_to_f32(b)
        seen |= np.uint32((b & 0x7FFF) >= 0x7C00)
    return seen


@njit(nogil=True, cache=True)
def _decode_bf16_any(dst, src_bits):
    """:func:`_decode_f16_any` for bfloat16 (a shift)."""
    seen = np.uint32(0)
    for i in range(src_bits.size):
        b = src_bits[i]
        dst[i] = half._f32_of_bf16(b)
        seen |= np.uint32((b & 0x7FFF) >= 0x7F80)
    return seen


@njit(nogil=True, cache=True)
def _count_nonfinite_bits(bits, exponent_mask):
    """How many 16-bit patterns have an all-ones exponent (inf or NaN); branch-free, so it vectorises."""
    n = 0
    for i in range(bits.size):
        n += np.int64(bits[i] & exponent_mask == exponent_mask)
    return n
