"""The engine: named, asynchronous, negotiated, fused and compressed allreduce.

=================  ==============================================================
module             what it holds
=================  ==============================================================
engine.py          :class:`Engine`: what the caller's thread does (submit, join, shutdown)
cycle.py           the engine thread: drain, negotiate, plan, run each batch's hook
handle.py          :class:`Handle` (what ``allreduce_async`` returns), ``Entry``
negotiation.py     the response cache: agreeing which names are ready everywhere
fusion.py          packing ready tensors into one buffer, one allreduce per batch
hooks.py           ``CommHook``: what runs one fused bucket (compressors are the simplest)
compression.py     ``Compression.none / fp16 / bf16``, the ``Compressor`` interface
halfcast.py        the fused fp16/bf16 cast loops (numba)
powersgd.py        ``PowerSGD``: a low-rank approximation by power iteration
onebit.py          ``OneBit``: sign bits and a scale per chunk, two error feedbacks
stall.py           warnings (and ``StallError``) for names only some ranks submitted
timeline.py        the Chrome-trace timeline
=================  ==============================================================
"""
from .compression import Compression, Compressor, HalfCompressor, NoneCompressor
from .engine import Engine
from .handle import Handle
from .hooks import Bucket, CommHook, HookComm
from .onebit import OneBit
from .powersgd import PowerSGD

__all__ = ["Engine", "Handle", "Compression", "Compressor", "HalfCompressor", "NoneCompressor",
           "CommHook", "Bucket", "HookComm", "PowerSGD", "OneBit"]
