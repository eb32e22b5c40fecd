"""The engine: named, asynchronous, negotiated, fused and compressed allreduce.

=================  ==============================================================
module             what it holds
=================  ==============================================================
engine.py          :class:`Engine`, the background thread and its cycle
handle.py          :class:`Handle` (what ``allreduce_async`` returns), ``Entry``
negotiation.py     the response cache: agreeing which names are ready everywhere
fusion.py          packing ready tensors into one buffer, one allreduce per batch
compression.py     ``Compression.none / fp16 / bf16``, the ``Compressor`` interface
stall.py           warnings (and ``StallError``) for names only some ranks submitted
timeline.py        the Chrome-trace timeline
=================  ==============================================================
"""
from .compression import Compression, Compressor, HalfCompressor, NoneCompressor
from .engine import Engine
from .handle import Handle

__all__ = ["Engine", "Handle", "Compression", "Compressor", "HalfCompressor", "NoneCompressor"]
