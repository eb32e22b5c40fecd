"""Gradient compression: ``compress(x) -> (payload, ctx)`` and ``decompress(payload, ctx)``.

Horovod's interface (``horovod/tensorflow/compression.py``), on numpy arrays::

    handle = ar.allreduce_async(grad, name="w", compression=ar.Compression.fp16)

A compressor is any object with those two methods and a ``name`` (the name
travels in the engine's cross-rank check, so every rank must use the same
one). Write your own by subclassing :class:`Compressor`; the engine calls
``compress`` once when the tensor enters the engine and ``decompress`` on the
reduced payload.

The built-in ``fp16`` and ``bf16`` compressors also have a fused path the
engine uses instead: the cast is done by one numba loop (built on
``kernels.half``'s rounding) that writes 16-bit patterns straight into the
fusion buffer, multiplies by a scale on the way (``Average`` pre-divides by
p there, so an fp16 sum of p gradients does not overflow where their
average would not), and counts values that became non-finite (fp16
overflows above 65504). Decoding counts non-finite results the same way,
which catches a sum that overflowed on the wire. Only float32 and float64
tensors are compressed; every other dtype passes through unchanged, as in
Horovod.

The cast loops themselves are numba kernels in halfcast.py.

``error_feedback=True`` keeps, per tensor name, what rounding lost this step
and adds it back next step (``Compression.fp16.with_error_feedback()``).

A compressor is the simplest communication hook (hooks.py): its
``run_batch`` is fusion's pack, one allreduce, unpack. A duck-typed object
with ``compress``, ``decompress`` and ``name`` is wrapped in one.
"""
from __future__ import annotations

import math

import numpy as np

from ..kernels import half
from ..ops import SUPPORTED_DTYPES
from .halfcast import (_count_nonfinite_bits, _decode_bf16_any, _decode_checked, _decode_f16_any,
                       _encode_bf16_any, _encode_checked, _encode_f16_any, _encode_f32_fast, _encode_feedback)
from .hooks import CommHook

__all__ = ["Compressor", "NoneCompressor", "HalfCompressor", "Compression", "check_compressor", "precompress"]

_COMPRESSIBLE = (np.dtype(np.float32), np.dtype(np.float64))


class Compressor(CommHook):
    """Base class: the identity. Subclasses override :meth:`compress` and :meth:`decompress`."""

    name = "none"
    direct_ok = True
    keeps_state = False

    def run_batch(self, batch, comm):
        """The hook of a compressor: pack (compress) the batch into one buffer, one allreduce, unpack."""
        return comm.fusion.run(batch)

    def check(self, dtype, op, rank) -> None:
        """Any dtype and op: a tensor the compressor cannot shrink passes through as it is."""

    def compress(self, x: np.ndarray):
        """Return ``(payload, ctx)``: the array to reduce and what :meth:`decompress` needs."""
        return x, None

    def decompress(self, payload: np.ndarray, ctx) -> np.ndarray:
        """Undo :meth:`compress` on the reduced payload."""
        return payload

    def wire_dtype(self, dtype: np.dtype) -> np.dtype | None:
        """The dtype on the wire for a fused compressor; ``None`` means: call :meth:`compress`."""
        return None

    def __repr__(self) -> str:
        return f"ar.Compression.{self.name}" if self.name in _BUILTIN_NAMES else f"<compressor {self.name}>"


class NoneCompressor(Compressor):
    """No compression: the payload is the tensor itself (no copy)."""

    name = "none"

    def wire_dtype(self, dtype):
        return np.dtype(dtype)


def _power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return x > 0 and m == 0.5


class HalfCompressor(Compressor):
    """Cast float32/float64 to a 16-bit float (``fp16`` or ``bf16``) for the wire."""

    def __init__(self, fmt: half.HalfFormat, name: str, *, error_feedback: bool = False):
        self.fmt = fmt
        self.error_feedback = error_feedback
        self.name = name + ("+ef" if error_feedback else "")
        self._base = name

    def with_error_feedback(self) -> "HalfCompressor":
        """The same cast, carrying each named tensor's rounding error into its next step."""
        return HalfCompressor(self.fmt, self._base, error_feedback=True)

    def wire_dtype(self, dtype):
        return self.fmt.dtype if np.dtype(dtype) in _COMPRESSIBLE else np.dtype(dtype)

    def compress(self, x):
        x = np.asarray(x)
        if x.dtype not in _COMPRESSIBLE:
            return x, None
        flat = np.ascontiguousarray(x).reshape(-1)
        bits = np.empty(flat.size, np.uint16)
        self.encode_into(bits, flat, 1.0)
        return bits.view(self.fmt.dtype).reshape(x.shape), x.dtype

    def decompress(self, payload, ctx):
        if ctx is None:
            return payload
        out = np.empty(payload.shape, ctx)
        self.decode_into(out.reshape(-1), np.ascontiguousarray(payload).reshape(-1), 1.0)
        return out

    # -- the fused path the engine uses ------------------------------------------------
    def encode_into(self, dst_bits: np.ndarray, src: np.ndarray, scale: float,
                    residual: np.ndarray | None = None) -> tuple[int, int]:
        """Write ``src * scale`` as 16-bit patterns into ``dst_bits`` (uint16, 1-D).

        Args:
            dst_bits: destination, a uint16 view of the fusion buffer.
            src: contiguous 1-D float32/float64 input.
            scale: multiplied in before rounding (``1/p`` for Average).
            residual: error-feedback state of this tensor (same dtype and size as
                ``src``), added in and then overwritten with the new rounding error.

        Returns:
            ``(overflowed, nonfinite)``: how many finite inputs became inf/NaN (0 means the
            payload is safe to send), and how many inputs were inf/NaN already.
        """
        f = self.fmt
        if residual is None and src.dtype == np.float32 and _power_of_two(scale) and f.bias in (15, 127):
            scale32 = np.float32(scale)
            seen = _encode_f16_any(dst_bits, src, scale32) if f.bias == 15 else \
                _encode_bf16_any(dst_bits, src, scale32, f.nan_bits)
            if not seen:
                return 0, 0                                  # every value finite: nothing to count
            bad, nonfinite = _encode_f32_fast(dst_bits, src, np.float32(scale), f.bias == 15, f.nan_bits)
        elif residual is None:
            bad, nonfinite = _encode_checked(dst_bits, src, scale, f.mant_bits, f.bias, f.overflow, f.nan_bits)
        else:
            bad, nonfinite = _encode_feedback(dst_bits, src, residual, scale, f.table, f.mant_bits, f.bias,
                                              f.overflow, f.nan_bits)
        return int(bad), int(nonfinite)

    def count_nonfinite(self, bits: np.ndarray) -> int:
        """How many of the 16-bit values in ``bits`` (uint16) are inf or NaN: a read of the payload
        only, so a result can be checked before it overwrites anything."""
        return int(_count_nonfinite_bits(bits, np.uint16(0x7C00 if self.fmt.bias == 15 else 0x7F80)))

    def decode_into(self, dst: np.ndarray, src_bits: np.ndarray, scale: float) -> int:
        """``dst = float(src_bits) * scale`` in one pass; return how many results are inf/NaN."""
        if scale == 1.0 and dst.dtype == np.float32 and self.fmt.bias in (15, 127):
            bits = src_bits.view(np.uint16)
            seen = (_decode_f16_any if self.fmt.bias == 15 else _decode_bf16_any)(dst, bits)
            return self.count_nonfinite(bits) if seen else 0
        return int(_decode_checked(dst, src_bits.view(np.uint16), scale, self.fmt.table))


_BUILTIN_NAMES = ("none", "fp16", "bf16")


class Compression:
    """The built-in compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none: Compressor = NoneCompressor()
    fp16: HalfCompressor = HalfCompressor(half.FLOAT16, "fp16")
    bf16: HalfCompressor = HalfCompressor(half.BFLOAT16, "bf16")


#: The built-in compressors by name (error feedback included): what a joined rank can rebuild to
#: reduce zeros for a tensor it never submitted (negotiation.py's join).
BUILTIN = {c.name: c for c in (Compression.none, Compression.fp16, Compression.bf16,
                               Compression.fp16.with_error_feedback(), Compression.bf16.with_error_feedback())}
BUILTIN_NAMES = frozenset(BUILTIN)


class _Adapted(Compressor):
    """A duck-typed compressor (``compress``, ``decompress``, ``name``) as a :class:`Compressor`."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.compress, self.decompress = inner.compress, inner.decompress

    def wire_dtype(self, dtype):
        wire = getattr(self.inner, "wire_dtype", None)
        return wire(dtype) if wire is not None else None


def check_compressor(compression) -> CommHook:
    """Return ``compression`` as a hook (a compressor is one); raise ``TypeError`` if it is neither
    a :class:`~allreduce.engine.hooks.CommHook` nor an object with compress, decompress and name."""
    if compression is None:
        return Compression.none
    if isinstance(compression, CommHook):
        return compression
    for attr in ("compress", "decompress", "name"):
        if not hasattr(compression, attr):
            raise TypeError(f"compression must be ar.Compression.none/fp16/bf16 or an object with "
                            f"compress(), decompress() and name; {compression!r} has no {attr!r}")
    return _Adapted(compression)


def precompress(entry, rank: int) -> Exception | None:
    """Run a custom compressor (one with no wire dtype) on an engine entry, once, before
    negotiation: set ``entry.payload``, ``entry.ctx`` and the payload's part of ``entry.meta``
    (so ranks whose payloads differ fail the negotiation, naming them). Returns the error to
    fail the entry with, or None."""
    try:
        payload, entry.ctx = entry.compressor.compress(entry.array)
    except Exception as exc:  # noqa: BLE001 - reported on the handle
        return exc
    if not isinstance(payload, np.ndarray) or payload.dtype not in SUPPORTED_DTYPES:
        kind = type(payload).__name__ + ("" if payload is None else f" of {getattr(payload, 'dtype', '?')}")
        return TypeError(f"rank {rank}: compressor {entry.compressor.name!r} returned a {kind} for tensor "
                         f"{entry.name!r}; a payload must be a numpy array of a supported dtype")
    entry.payload = np.ascontiguousarray(payload).reshape(-1)
    entry.meta = entry.meta[:3] + (f"{entry.compressor.name} -> {entry.payload.dtype}[{entry.payload.size}]",)
    return None
