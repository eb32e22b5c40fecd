"""Pure functions that cut a buffer of ``count`` elements into pieces.

Every algorithm agrees with its peers on these numbers without talking:
each rank calls the same function with the same arguments.

``chunks(10, 4)`` -> sizes ``[3, 3, 2, 2]``, offsets ``[0, 3, 6, 8]``:
the first ``count % p`` chunks get one extra element, so sizes differ by at
most one and a count smaller than ``p`` leaves some chunks empty.
"""
from __future__ import annotations

from functools import lru_cache

__all__ = ["chunk_sizes", "chunk_offsets", "chunks", "segments", "num_segments", "messages", "MESSAGE_BYTES"]


def chunk_sizes(count: int, parts: int) -> list[int]:
    """Sizes of ``parts`` nearly equal pieces of ``count`` elements."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def chunk_offsets(count: int, parts: int) -> list[int]:
    """Start offset of each piece from :func:`chunk_sizes`."""
    offsets, at = [], 0
    for n in chunk_sizes(count, parts):
        offsets.append(at)
        at += n
    return offsets


@lru_cache(maxsize=256)
def chunks(count: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` of each of ``parts`` pieces. Cached: it is on the hot path."""
    return tuple(zip(chunk_offsets(count, parts), chunk_sizes(count, parts)))


def num_segments(count: int, itemsize: int, segment_bytes: int) -> int:
    """How many pipeline segments a piece of ``count`` elements is cut into."""
    if segment_bytes <= 0 or count == 0:
        return 1
    return max(1, -(-count * itemsize // segment_bytes))


@lru_cache(maxsize=1024)
def segments(offset: int, size: int, nseg: int) -> tuple[tuple[int, int], ...]:
    """Cut the piece ``[offset, offset+size)`` into ``nseg`` pieces, dropping empty ones."""
    return tuple((offset + o, n) for o, n in chunks(size, nseg) if n > 0)


MESSAGE_BYTES = 256 << 10
"""Reduce-scatter and allgather send a block as messages of at most this many bytes (the ring's
segment size), a window of them at a time (``transport.base.send_recv_messages``)."""


def messages(offset: int, count: int, itemsize: int, max_bytes: int = MESSAGE_BYTES) -> tuple[tuple[int, int], ...]:
    """``[offset, offset + count)`` as (start, length) messages of at most ``max_bytes`` (none if empty)."""
    return segments(offset, count, num_segments(count, itemsize, max_bytes))
