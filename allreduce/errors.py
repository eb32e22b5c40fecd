"""Every exception the library raises on purpose.

One module, one base class. Each message says what is wrong, on which
rank, and what to do about it. Errors that come from a disagreement between
ranks are raised on *every* rank with the same text, so no rank is left
waiting for a peer that has already given up.
"""

__all__ = [
    "AllreduceError",
    "NotInitializedError",
    "InvalidArgumentError",
    "MismatchError",
    "TransportError",
    "TransportTimeoutError",
    "PeerLostError",
    "ShutdownError",
    "StallError",
    "CompressionError",
    "ClusterError",
    "HostsUpdatedInterrupt",
]


class AllreduceError(RuntimeError):
    """Base class of every error raised by this library."""


class NotInitializedError(AllreduceError, TypeError):
    """A collective was called before ``init()`` or after ``shutdown()``."""


class InvalidArgumentError(AllreduceError, TypeError, ValueError):
    """An argument is invalid on this rank (a ``root_rank`` out of range, say).

    Raised before any communication. It is both a ``TypeError`` and a
    ``ValueError``, so either ``except`` clause catches it.
    """


class MismatchError(AllreduceError):
    """Ranks disagree about a collective's count, dtype, op, root or name.

    Raised on every rank, with every rank's value in the message.
    """


class TransportError(AllreduceError):
    """A point-to-point transfer failed."""


class TransportTimeoutError(TransportError):
    """A transfer waited longer than the configured timeout for its peer."""


class PeerLostError(TransportError):
    """A peer rank died or aborted the job; the message names it."""


class ShutdownError(AllreduceError):
    """The engine was shut down while this operation was pending."""


class StallError(AllreduceError):
    """A named tensor was not submitted by every rank within the stall shutdown time."""


class CompressionError(AllreduceError):
    """Compression produced a non-finite value (for example fp16 overflow)."""


class ClusterError(AllreduceError):
    """``allreduce-cluster`` could not make, use or remove its namespace hosts (allreduce/cluster/)."""


class HostsUpdatedInterrupt(AllreduceError):
    """Raised by an elastic ``state.commit()`` on every rank alike when the world can grow back
    (``--max-np``); :func:`allreduce.elastic.run` catches it, spawns replacements and goes on."""
