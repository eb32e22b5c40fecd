"""Reductions on CUDA device arrays: numba.cuda kernels, CuPy as the fallback.

The same primitives as the host kernels in :mod:`allreduce.kernels`, for
device arrays (numba device arrays, CuPy arrays, anything with
``__cuda_array_interface__``), each launched on a stream:

    reduce_into(dst, src, op)             dst = dst (op) src
    reduce_finish_into(dst, src, op, p)   the same, and for Average also / p (fused)
    finish(buf, op, p)                    for Average: buf /= p
    encode_into / decode_into             float32/64 * scale <-> fp16/bf16 bits (compression)

Every kernel is a grid-stride loop over memory, written with the very
operand types of the CPU kernels (explicit ``float64(...)`` casts where
numba's CPU typing would widen), so device and host results are bitwise
equal. float16 and bfloat16 work on ``uint16`` bit patterns exactly as
:mod:`.half` does, with its decode tables and a device copy of its
``_encode`` (the tests compare the two bit for bit). bfloat16 device arrays are ``uint16`` arrays,
because neither numba nor CuPy has the dtype: pass ``dtype=ar.bfloat16``.

numba is the first choice (see :func:`backend`). Where it cannot compile for
the GPU (no libNVVM) but CuPy works, the same operations run as CuPy
``ElementwiseKernel``\\ s, whose half encoder is a C port of ``_encode``.
Under ``NUMBA_ENABLE_CUDASIM=1`` the numba kernels run on the CPU, which
is how the tests check them on a machine without a GPU.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float64, int64
from numba.core import config as _numba_config

from ..ops import Op, bfloat16
from . import half

__all__ = ["SIMULATED", "backend", "reduce_into", "reduce_finish_into", "finish", "copy_into",
           "encode_into", "decode_into", "half_format", "as_numba"]

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


@functools.lru_cache(maxsize=1)
def _numba_works() -> bool:
    try:
        if SIMULATED:
            return True
        from numba.cuda.cudadrv import nvvm
        return bool(cuda.is_available()) and nvvm.is_available()   # a driver, and a compiler
    except Exception:                              # noqa: BLE001 - a broken driver means "no"
        return False


@functools.lru_cache(maxsize=1)
def _cupy():
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:                              # noqa: BLE001 - not installed, or no GPU
        return None


def backend() -> str | None:
    """``"numba"``, ``"cupy"`` or None (no usable GPU): which kernels run, decided on first use."""
    if _numba_works():
        return "numba"
    return "cupy" if _cupy() is not None else None


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


def reduce_into(dst, src, op: Op, *, dtype=None, stream=0) -> None:
    """``dst = dst (op) src`` on the device, queued on ``stream``. For Average the plain sum.

    Args:
        dst, src: device arrays of the same length and dtype (1-D, contiguous).
        op: the reduction.
        dtype: the logical dtype, when it differs from ``dst.dtype`` (bfloat16 held as uint16).
        stream: a numba stream (default: the null stream).
    """
    _reduce(dst, src, op, 1, dtype, stream)


def reduce_finish_into(dst, src, op: Op, nranks: int, *, dtype=None, stream=0) -> None:
    """As :func:`reduce_into`; for Average also divide by ``nranks`` in the same pass."""
    _reduce(dst, src, op, nranks, dtype, stream)


def _reduce(dst, src, op: Op, nranks: int, dtype, stream) -> None:
    n = dst.size
    if n == 0:
        return
    dtype = np.dtype(dtype or dst.dtype)
    fused = op == Op.AVERAGE and nranks > 1
    if backend() == "cupy":
        return _cupy_reduce(dst, src, op, nranks if fused else 1, dtype, stream)
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


def finish(buf, op: Op, nranks: int, *, dtype=None, stream=0) -> None:
    """Apply Average's divide to a fully reduced device buffer (no-op for other ops)."""
    n = buf.size
    if op != Op.AVERAGE or nranks == 1 or n == 0:
        return
    dtype = np.dtype(dtype or buf.dtype)
    if backend() == "cupy":
        return _cupy_finish(buf, nranks, dtype, stream)
    fmt = half_format(dtype)
    if fmt is not None:
        _avg_half[_launch(n, stream)](_bits(buf, dtype), nranks, _table(fmt), *_fmt_args(fmt))
    elif dtype.kind == "f":
        _avg[_launch(n, stream)](buf, nranks)
    else:
        _int_avg[_launch(n, stream)](buf, nranks)


def as_numba(x):
    """A numba device array viewing ``x`` (zero-copy for anything with ``__cuda_array_interface__``)."""
    if SIMULATED or hasattr(x, "copy_to_host"):
        return x
    return cuda.as_cuda_array(x)


def copy_into(dst, src, *, stream=0) -> None:
    """``dst[:] = src`` device to device, queued on ``stream``."""
    if dst.size:
        as_numba(dst).copy_to_device(as_numba(src), stream=stream)


def encode_into(dst_bits, src, scale: float, dtype, *, stream=0) -> None:
    """``dst_bits = bits(src * scale)``: float32/64 to fp16/bf16 patterns, rounded to nearest even."""
    fmt = half_format(dtype)
    if fmt is None:
        raise TypeError(f"encode_into casts to float16 or bfloat16, not {np.dtype(dtype)}")
    if src.size:
        _encode_scaled[_launch(src.size, stream)](dst_bits, src, float(scale), *_fmt_args(fmt))


def decode_into(dst, src_bits, scale: float, dtype, *, stream=0) -> None:
    """``dst = value(src_bits) * scale``: fp16/bf16 patterns back to float32/64."""
    fmt = half_format(dtype)
    if fmt is None:
        raise TypeError(f"decode_into casts from float16 or bfloat16, not {np.dtype(dtype)}")
    if src_bits.size:
        _decode_scaled[_launch(src_bits.size, stream)](dst, src_bits, float(scale), _table(fmt))


# -- CuPy fallback: the same kernels as CUDA C, for a machine where numba cannot compile -----
_C_ENCODE = r"""
__device__ unsigned short ar_encode(double v, int mant_bits, int bias, double overflow, int nan_bits) {
    int sign = signbit(v) ? 0x8000 : 0;
    if (v != v) return sign | nan_bits;
    double a = fabs(v);
    if (a >= overflow) return sign | ((2 * bias + 1) << mant_bits);
    if (a < ldexp(1.0, 1 - bias)) return sign | (int)rint(a * ldexp(1.0, bias - 1 + mant_bits));
    int e;
    double frac = frexp(a, &e);
    int m = (int)rint(frac * ldexp(1.0, mant_bits + 1));
    int ex = e - 1 + bias;
    if (m == (1 << (mant_bits + 1))) { m >>= 1; ex += 1; }
    return sign | (ex << mant_bits) | (m - (1 << mant_bits));
}
"""
_C_NATIVE = {
    _SUM: "d = d + s", _PROD: "d = d * s",
    _MIN: "if (s < d || s != s) d = s", _MAX: "if (s > d || s != s) d = s",
    _AVG: "d = d + s; d = (T)((double)d / n)",
}
_C_INT_AVG = "d = d + s; long long v = (long long)d; long long q = (v < 0 ? -v : v) / n; d = (T)(v >= 0 ? q : -q)"
_C_INT_FINISH = "long long v = (long long)d; long long q = (v < 0 ? -v : v) / n; d = (T)(v >= 0 ? q : -q)"
_C_HALF = r"""
float a = table[d], b = table[s];
if (op == 2) { if (b < a || b != b) d = s; }
else if (op == 3) { if (b > a || b != b) d = s; }
else {
    float v = (op == 4) ? a * b : a + b;
    unsigned short bits = ar_encode((double)v, mant_bits, bias, overflow, nan_bits);
    if (op == 1) bits = ar_encode((double)table[bits] / n, mant_bits, bias, overflow, nan_bits);
    d = bits;
}"""


@functools.lru_cache(maxsize=None)
def _cupy_kernel(kind: str, code: int):
    cp = _cupy()
    if kind == "half":
        return cp.ElementwiseKernel(
            "uint16 s, int64 n, int32 op, raw float32 table, int32 mant_bits, int32 bias, "
            "float64 overflow, int32 nan_bits", "uint16 d", _C_HALF, "ar_half", preamble=_C_ENCODE)
    if kind == "half_avg":
        return cp.ElementwiseKernel(
            "int64 n, raw float32 table, int32 mant_bits, int32 bias, float64 overflow, int32 nan_bits",
            "uint16 d", "d = ar_encode((double)table[d] / n, mant_bits, bias, overflow, nan_bits)",
            "ar_half_avg", preamble=_C_ENCODE)
    if kind in ("finish", "finish_int"):
        body = _C_INT_FINISH if kind == "finish_int" else "d = (T)((double)d / n)"
        return cp.ElementwiseKernel("int64 n", "T d", body, f"ar_{kind}")
    body = _C_INT_AVG if kind == "int" else _C_NATIVE[code]
    return cp.ElementwiseKernel("T s, int64 n", "T d", body, f"ar_{kind}_{code}")


def _cupy_stream(stream):
    cp = _cupy()
    handle = getattr(getattr(stream, "handle", None), "value", None)
    return cp.cuda.ExternalStream(handle) if handle else cp.cuda.Stream.null


def _cupy_reduce(dst, src, op: Op, n: int, dtype: np.dtype, stream) -> None:
    cp = _cupy()
    d, s = cp.asarray(dst), cp.asarray(src)
    code = _AVG if n > 1 else (_SUM if op == Op.AVERAGE else int(op))
    with _cupy_stream(stream):
        fmt = half_format(dtype)
        if fmt is not None:
            table = _cupy_table(fmt)
            _cupy_kernel("half", 0)(s.view(cp.uint16), n, code, table, *_fmt_args(fmt), d.view(cp.uint16))
        elif code == _AVG and dtype.kind != "f":
            _cupy_kernel("int", _AVG)(s, n, d)
        else:
            _cupy_kernel("native", code)(s, n, d)


def _cupy_finish(buf, n: int, dtype: np.dtype, stream) -> None:
    cp = _cupy()
    d = cp.asarray(buf)
    fmt = half_format(dtype)
    with _cupy_stream(stream):
        if fmt is not None:
            _cupy_kernel("half_avg", 0)(n, _cupy_table(fmt), *_fmt_args(fmt), d.view(cp.uint16))
        else:
            _cupy_kernel("finish_int" if dtype.kind != "f" else "finish", 0)(n, d)


@functools.lru_cache(maxsize=None)
def _cupy_table_cached(name: str, device: int):
    return _cupy().asarray(half_format(bfloat16 if name == "bfloat16" else np.float16).table)


def _cupy_table(fmt: half.HalfFormat):
    return _cupy_table_cached(fmt.dtype.name, _cupy().cuda.Device().id)

