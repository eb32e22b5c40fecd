"""The CuPy fallback: the numba.cuda kernels ported to CUDA C, as CuPy ``ElementwiseKernel``\\ s.

Used where numba cannot compile for the GPU (no libNVVM) but CuPy works; :func:`.cuda.backend`
decides. Each kernel body is the C twin of a kernel in :mod:`.cuda_numba`,
with the same op codes and :func:`~.cuda_numba.half_format` arguments, and
``ar_encode`` is a C port of :func:`.half._encode` (round to nearest even).
The bodies are plain C99 arithmetic, so ``tests/test_cuda.py`` compiles them
as host C and checks them bit for bit against the CPU kernels without a GPU.

:func:`reduce` and :func:`finish` take what :mod:`.cuda` passes to the numba
launchers (non-empty arrays, a resolved dtype) and run on ``stream`` (a numba
stream, wrapped as a CuPy ``ExternalStream``). :func:`_cupy` answers whether
CuPy and a GPU are there at all; :mod:`allreduce.device` asks it too.
"""
from __future__ import annotations

import functools

import numpy as np

from ..ops import Op, bfloat16
from . import half
from .cuda_numba import _AVG, _MAX, _MIN, _PROD, _SUM, _fmt_args, half_format

__all__ = ["reduce", "finish"]


@functools.lru_cache(maxsize=1)
def _cupy():
    """The ``cupy`` module if it imports and sees a GPU, else None (asked once)."""
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:                              # noqa: BLE001 - not installed, or no GPU
        return None


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
def _kernel(kind: str, code: int):
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


def _stream(stream):
    cp = _cupy()
    handle = getattr(getattr(stream, "handle", None), "value", None)
    return cp.cuda.ExternalStream(handle) if handle else cp.cuda.Stream.null


def reduce(dst, src, op: Op, nranks: int, dtype: np.dtype, stream) -> None:
    """As :func:`.cuda_numba.reduce`: ``dst (op)= src``, and for Average with ``nranks > 1`` also ``/ nranks``."""
    n = nranks if op == Op.AVERAGE and nranks > 1 else 1
    cp = _cupy()
    d, s = cp.asarray(dst), cp.asarray(src)
    code = _AVG if n > 1 else (_SUM if op == Op.AVERAGE else int(op))
    with _stream(stream):
        fmt = half_format(dtype)
        if fmt is not None:
            table = _table(fmt)
            _kernel("half", 0)(s.view(cp.uint16), n, code, table, *_fmt_args(fmt), d.view(cp.uint16))
        elif code == _AVG and dtype.kind != "f":
            _kernel("int", _AVG)(s, n, d)
        else:
            _kernel("native", code)(s, n, d)


def finish(buf, n: int, dtype: np.dtype, stream) -> None:
    """As :func:`.cuda_numba.finish`: Average's divide ``buf /= n``."""
    cp = _cupy()
    d = cp.asarray(buf)
    fmt = half_format(dtype)
    with _stream(stream):
        if fmt is not None:
            _kernel("half_avg", 0)(n, _table(fmt), *_fmt_args(fmt), d.view(cp.uint16))
        else:
            _kernel("finish_int" if dtype.kind != "f" else "finish", 0)(n, d)


@functools.lru_cache(maxsize=None)
def _table_cached(name: str, device: int):
    return _cupy().asarray(half_format(bfloat16 if name == "bfloat16" else np.float16).table)


def _table(fmt: half.HalfFormat):
    return _table_cached(fmt.dtype.name, _cupy().cuda.Device().id)
