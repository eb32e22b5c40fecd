"""The numba.cuda kernels: one grid-stride loop per reduction, for a real GPU or the simulator.

These are the device twins of the host kernels in :mod:`.cpu` and :mod:`.half`,
written with the very operand types of the CPU kernels (explicit
``float64(...)`` casts where numba's CPU typing would widen), so device and
host results are bitwise equal. float16 and bfloat16 work on ``uint16`` bit
patterns exactly as :mod:`.half` does, with its decode tables and a device
copy of its ``_encode`` (the tests compare the two bit for bit).

This module also fixes the calling convention every device backend shares:
the op codes of :mod:`.half` (``_SUM`` ... ``_PROD``), :func:`half_format` and
``_fmt_args``. :mod:`.cupy_fallback` ports the same kernels to CUDA C on top
of it. Callers go through :mod:`.cuda`, which picks numba or CuPy; the
launchers here (:func:`reduce`, :func:`finish`, :func:`encode`, :func:`decode`)
take a non-empty array and a resolved dtype and queue one kernel on ``stream``.
Under ``NUMBA_ENABLE_CUDASIM=1`` the kernels run on the CPU (:data:`SIMULATED`).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64, int64
from numba.core import config as _numba_config

from ..ops import Op, bfloat16
from . import half

__all__ = ["SIMULATED", "half_format", "reduce", "finish", "encode", "decode"]

#: True when numba's CUDA simulator stands in for a GPU (NUMBA_ENABLE_CUDASIM=1).
SIMULATED = bool(_numba_config.ENABLE_CUDASIM)
_SUM, _AVG, _MIN, _MAX, _PROD = 0, 1, 2, 3, 4      # the op codes of .half
_HALF = {np.dtype(np.float16): half.FLOAT16, bfloat16: half.BFLOAT16}


@cuda.jit(device=True)
def _encode(v, mant_bits, bias, overflow, nan_bits):
    """float -> 16-bit pattern, round to nearest even: ``half._encode`` line for line, with
    ``round()`` (ties to even, as Python's) for ``np.rint``, which numba.cuda does not offer."""
    sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
    if v != v:
        return sign | nan_bits
    a = abs(v)
    if a >= overflow:
        return sign | ((2 * bias + 1) << mant_bits)        # infinity
    min_normal = 2.0 ** (1 - bias)
    if a < min_normal:                                     # subnormal (or zero)
        return sign | round(a * 2.0 ** (bias - 1 + mant_bits))
    frac, e = math.frexp(a)                                # a = frac * 2**e, frac in [0.5, 1)
    m = round(frac * 2.0 ** (mant_bits + 1))
    exp = e - 1 + bias
    if m == 1 << (mant_bits + 1):                          # rounding carried into the exponent
        m >>= 1
        exp += 1
    return sign | (exp << mant_bits) | (m - (1 << mant_bits))


@cuda.jit(cache=True)
def _sum(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] + src[i]


@cuda.jit(cache=True)
def _prod(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] * src[i]


@cuda.jit(cache=True)
def _min(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        s = src[i]
        if s < dst[i] or s != s:                   # a NaN wins, as in np.minimum
            dst[i] = s


@cuda.jit(cache=True)
def _max(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        s = src[i]
        if s > dst[i] or s != s:
            dst[i] = s


@cuda.jit(cache=True)
def _sum_avg(dst, src, n):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = float64(dst[i] + src[i]) / n      # float32 sum, float64 divide: as cpu.sum_avg_into


@cuda.jit(cache=True)
def _avg(dst, n):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = float64(dst[i]) / n


@cuda.jit(cache=True)
def _int_sum_avg(dst, src, n):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] + src[i]                   # wrap in the dtype first (ncclAvg)
        v = int64(dst[i])                          # widen: abs(int8(-128)) is -128 in int8
        q = abs(v) // n
        dst[i] = q if v >= 0 else -q


@cuda.jit(cache=True)
def _int_avg(dst, n):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        v = int64(dst[i])
        q = abs(v) // n
        dst[i] = q if v >= 0 else -q


@cuda.jit(cache=True)
def _reduce_half(dst, src, op, n, table, mant_bits, bias, overflow, nan_bits):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        a = table[dst[i]]
        b = table[src[i]]
        if op == _MIN:
            if b < a or b != b:
                dst[i] = src[i]
        elif op == _MAX:
            if b > a or b != b:
                dst[i] = src[i]
        else:
            v = a * b if op == _PROD else a + b    # float32 arithmetic, as numpy's float16
            bits = _encode(float64(v), mant_bits, bias, overflow, nan_bits)
            if op == _AVG:                         # round the sum, then the quotient (= .half)
                bits = _encode(float64(table[bits]) / n, mant_bits, bias, overflow, nan_bits)
            dst[i] = bits


@cuda.jit(cache=True)
def _avg_half(dst, n, table, mant_bits, bias, overflow, nan_bits):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = _encode(float64(table[dst[i]]) / n, mant_bits, bias, overflow, nan_bits)


@cuda.jit(cache=True)
def _encode_scaled(dst_bits, src, scale, mant_bits, bias, overflow, nan_bits):
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst_bits[i] = _encode(float64(src[i]) * scale, mant_bits, bias, overflow, nan_bits)


@cuda.jit(cache=True)
def _decode_scaled(dst, src_bits, scale, table):
    for i in range(cuda.grid(1), src_bits.size, cuda.gridsize(1)):
        dst[i] = float64(table[src_bits[i]]) * scale


_NATIVE = {Op.SUM: _sum, Op.AVERAGE: _sum, Op.PRODUCT: _prod, Op.MIN: _min, Op.MAX: _max}


def half_format(dtype) -> half.HalfFormat | None:
    """The :class:`~allreduce.kernels.half.HalfFormat` of a 16-bit float dtype, else None."""
    return _HALF.get(np.dtype(dtype))


def _launch(n: int, stream) -> tuple:
    """Kernel configuration: a grid-stride loop needs no more threads than elements."""
    if SIMULATED:                                  # every simulated thread is a Python thread
        return 1, max(1, min(n, 8)), stream
    threads = 256
    return min(max(1, (n + threads - 1) // threads), 8192), threads, stream


def _device_id() -> int:
    if SIMULATED:
        return 0
    return cuda.get_current_device().id


_tables: dict[tuple[str, int], object] = {}


def _table(fmt: half.HalfFormat):
    """The 256 KiB decode table of ``fmt`` on the current device, uploaded once per device."""
    key = (fmt.dtype.name, _device_id())
    if key not in _tables:
        _tables[key] = cuda.to_device(fmt.table)
    return _tables[key]


def _bits(x, dtype) -> object:
    return x if np.dtype(x.dtype) == np.uint16 else x.view(np.uint16)


def _fmt_args(fmt: half.HalfFormat) -> tuple:
    _, mant_bits, bias, overflow, nan_bits = fmt.args
    return mant_bits, bias, overflow, nan_bits


def reduce(dst, src, op: Op, nranks: int, dtype: np.dtype, stream) -> None:
    """Queue ``dst = dst (op) src`` (and, for Average with ``nranks > 1``, ``/ nranks``) on ``stream``.

    Args:
        dst, src: non-empty device arrays of the same length (1-D, contiguous).
        op: the reduction.
        nranks: the divisor of Average's fused divide; 1 means the plain sum.
        dtype: the logical dtype (bfloat16 held as uint16).
        stream: a numba stream, or 0 for the null stream.
    """
    n = dst.size
    fused = op == Op.AVERAGE and nranks > 1
    fmt = half_format(dtype)
    if fmt is not None:
        code = int(op) if fused else (_SUM if op == Op.AVERAGE else int(op))
        _reduce_half[_launch(n, stream)](_bits(dst, dtype), _bits(src, dtype), code, nranks,
                                         _table(fmt), *_fmt_args(fmt))
    elif not fused:
        _NATIVE[op][_launch(n, stream)](dst, src)
    elif dtype.kind == "f":
        _sum_avg[_launch(n, stream)](dst, src, nranks)
    else:
        _int_sum_avg[_launch(n, stream)](dst, src, nranks)


def finish(buf, nranks: int, dtype: np.dtype, stream) -> None:
    """Queue Average's divide ``buf /= nranks`` on ``stream`` (``buf`` non-empty, ``nranks > 1``)."""
    n = buf.size
    fmt = half_format(dtype)
    if fmt is not None:
        _avg_half[_launch(n, stream)](_bits(buf, dtype), nranks, _table(fmt), *_fmt_args(fmt))
    elif dtype.kind == "f":
        _avg[_launch(n, stream)](buf, nranks)
    else:
        _int_avg[_launch(n, stream)](buf, nranks)


def encode(dst_bits, src, scale: float, fmt: half.HalfFormat, stream) -> None:
    """Queue ``dst_bits = bits(src * scale)`` in the 16-bit format ``fmt`` on ``stream``."""
    _encode_scaled[_launch(src.size, stream)](dst_bits, src, float(scale), *_fmt_args(fmt))


def decode(dst, src_bits, scale: float, fmt: half.HalfFormat, stream) -> None:
    """Queue ``dst = value(src_bits) * scale`` from the 16-bit format ``fmt`` on ``stream``."""
    _decode_scaled[_launch(src_bits.size, stream)](dst, src_bits, float(scale), _table(fmt))
