"""allreduce: a from-scratch gradient-synchronisation engine.

::

    import allreduce as ar, numpy as np
    ar.init()                                   # under mpirun / allreduce-run
    y = ar.allreduce(np.ones(10) * ar.rank(), op=ar.Sum)

See README.md for the layers and docs/ for the lessons.
"""
from .api import (allgather, allgather_object, allreduce, allreduce_, allreduce_async, allreduce_async_,
                  alltoall, barrier, broadcast,
                  broadcast_object, communicator, explain_choice, grouped_allreduce, grouped_allreduce_async, init, is_initialized,
                  join, local_rank, local_size, rank, reducescatter, shared_empty, shutdown, size,
                  start_timeline, stop_timeline, synchronize)
from .comm import Communicator
from .config import Config
from .engine import CommHook, Compression, Compressor, Handle, OneBit, PowerSGD
from .errors import (AllreduceError, CompressionError, InvalidArgumentError, MismatchError,
                     NotInitializedError, PeerLostError, ShutdownError, StallError, TransportError,
                     TransportTimeoutError)
from .ops import Adasum, Average, Max, Min, Op, Product, Sum, bfloat16

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "communicator", "rank", "size", "local_rank", "local_size",
    "allreduce", "allreduce_", "broadcast", "allgather", "reducescatter", "alltoall", "broadcast_object",
    "allgather_object", "barrier", "explain_choice", "shared_empty",
    "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async", "synchronize", "join", "Handle", "Compression", "Compressor",
    "CommHook", "PowerSGD", "OneBit",
    "start_timeline", "stop_timeline",
    "Op", "Sum", "Average", "Min", "Max", "Product", "Adasum", "bfloat16",
    "Communicator", "Config",
    "AllreduceError", "CompressionError", "InvalidArgumentError", "MismatchError",
    "NotInitializedError", "PeerLostError", "ShutdownError", "StallError", "TransportError",
    "TransportTimeoutError",
]
