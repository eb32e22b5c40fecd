"""``tfops.Compression``: the engine's compressors, also callable on TensorFlow tensors.

Horovod's ``Compression.fp16.compress(t)`` takes a ``tf.Tensor`` and returns
``(tf.Tensor, ctx)``; scripts and tests call it directly, eagerly and inside
``tf.function``. The engine's compressors (:mod:`allreduce.engine.compression`)
take numpy arrays, and the engine calls them, or their fused cast, on the
payloads it reduces. The compressors here are the same objects to the engine
(subclasses, same names, same fused path) and, given a TF tensor, cast it
with TF ops as Horovod does:

=========================  ===========================================  =========================
call                       TF tensor                                    numpy array
=========================  ===========================================  =========================
fp16.compress(t)           floating: ``(tf.cast(t, float16), dtype)``   the engine's cast
                           others: ``(t, None)``                        (float32/float64 only)
fp16.decompress(t, ctx)    ``tf.cast(t, ctx)`` (ctx None: ``t``)        the engine's decode
bf16                       the same with bfloat16                       the same
none                       ``(t, None)`` / ``t``                        the same
=========================  ===========================================  =========================
"""
from __future__ import annotations

import tensorflow as tf

import allreduce as ar
from allreduce.engine.compression import HalfCompressor, check_compressor

__all__ = ["Compression", "check_compression", "check_comm_hook"]


class _TensorHalf(HalfCompressor):
    """An engine half-float compressor whose compress/decompress also take TF tensors."""

    def __init__(self, engine: HalfCompressor, wire: tf.DType):
        super().__init__(engine.fmt, engine.name)
        self.wire = wire

    def compress(self, x):
        if not tf.is_tensor(x):
            return super().compress(x)
        if not x.dtype.is_floating:
            return x, None
        return tf.cast(x, self.wire), x.dtype

    def decompress(self, payload, ctx):
        if not tf.is_tensor(payload):
            return super().decompress(payload, ctx)
        return payload if ctx is None else tf.cast(payload, ctx)


class Compression:
    """``Compression.none``, ``Compression.fp16``, ``Compression.bf16`` (Horovod's names)."""

    none = ar.Compression.none                # (x, None) and x: already fine for any object
    fp16 = _TensorHalf(ar.Compression.fp16, tf.float16)
    bf16 = _TensorHalf(ar.Compression.bf16, tf.bfloat16)


def check_compression(compression):
    """The compressor the engine should use for ``compression`` (``None``: none); ``TypeError`` if
    it is not one."""
    return check_compressor(compression)


def check_comm_hook(hook, who: str = "comm_hook"):
    """``hook`` if it is a communication hook (an ``ar.CommHook``: ``ar.PowerSGD(...)``,
    ``ar.OneBit()``, a compressor, or your own subclass), ``None`` for none; ``TypeError``
    naming it otherwise (checked when the tape or optimizer is made, not at the first step)."""
    if hook is None or isinstance(hook, ar.CommHook):
        return hook
    hint = ""
    if isinstance(hook, type) and issubclass(hook, ar.CommHook):
        hint = f" (a class: pass an instance, e.g. {hook.__name__}())"
    elif isinstance(hook, str):
        hint = " (a name: pass the object, e.g. tfops.PowerSGD(rank=2))"
    raise TypeError(f"{who}: comm_hook must be an allreduce communication hook such as tfops.PowerSGD(rank=2) "
                    f"or tfops.OneBit(), or None; got {hook!r} of type {type(hook).__name__}{hint}")
