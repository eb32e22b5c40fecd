"""Why ``algorithm="auto"`` picks what it picks: every algorithm's predicted time, side by side.

::

    >>> from allreduce.algorithms.explain_choice import explain_choice
    >>> print(explain_choice(64 << 20, 2))
    allreduce of 64 MiB on 2 ranks (1 node of 2): predicted time per algorithm
      algorithm     time (us)   a*alpha    b*n*beta   g*n*gamma   note
      ring           ...

The message-passing algorithms use the alpha-beta-gamma model and fitted
constants of :mod:`.select`. ``shm`` and ``hierarchical`` have no messages
inside a node, so their model is the one in their docstrings:

    shm:           T = 2 ceil(n/W) sync  +  (7p-5)/p * n / B_mem
    hierarchical:  T = T_shm(n, L)  +  ring over N nodes on n/L bytes

with ``sync`` (one flag hand-off) and ``B_mem`` (bytes read + written per
second) from ``SHM_DEFAULTS`` below. ``auto`` itself still chooses among
``select.choose``'s candidates; the table marks its choice with ``<- auto``.
"""
from __future__ import annotations

import math

from . import select
from .shm import SLOT_BYTES

__all__ = ["predictions", "explain_choice", "SHM_DEFAULTS"]

# Measured on the 2-core development VM: a flag hand-off between two spinning
# processes, and np.copyto bandwidth (read + write) of a 128 MiB buffer.
SHM_DEFAULTS = {"sync": 10e-6, "bmem": 5.0e9}


def _shm_time(nbytes: int, p: int) -> float:
    if p <= 1 or nbytes == 0:
        return 0.0
    windows = math.ceil(nbytes / SLOT_BYTES)
    return 2 * windows * SHM_DEFAULTS["sync"] + (7 * p - 5) / p * nbytes / SHM_DEFAULTS["bmem"]


def predictions(nbytes: int, p: int, *, local_size: int | None = None,
                path: str = "") -> dict[str, tuple[float, str]]:
    """Predicted seconds of every algorithm with a model, and a note on each.

    Args:
        nbytes: message size in bytes.
        p: number of ranks.
        local_size: ranks per node (default: all ``p`` on one node).
        path: fitted cost-model file for :mod:`.select` ("" = the per-machine cache).

    Returns:
        ``{name: (seconds, note)}``; ``shm`` is absent when the ranks span nodes.
    """
    local = p if local_size is None else max(1, min(local_size, p))
    nodes = math.ceil(p / local)
    out: dict[str, tuple[float, str]] = {}
    for name in select.DEFAULTS:
        out[name] = (select.predict(name, nbytes, p, path=path), "alpha-beta-gamma, fitted")
    if nodes == 1:
        out["shm"] = (_shm_time(nbytes, p), "shared memory: syncs + bytes moved / B_mem")
    cross = select.predict("ring", math.ceil(nbytes / local), nodes, path=path) if nodes > 1 else 0.0
    out["hierarchical"] = (_shm_time(nbytes, local) + cross,
                           f"shm in {nodes} node(s) of {local} + ring across nodes on n/{local}")
    return out


def explain_choice(nbytes: int, p: int, *, local_size: int | None = None, path: str = "") -> str:
    """A table of every algorithm's predicted time for one allreduce, fastest first.

    Args:
        nbytes: message size in bytes.
        p: number of ranks.
        local_size: ranks per node (default: all ``p`` on one node).
        path: fitted cost-model file ("" = the per-machine cache).

    Returns:
        The table as text (one line per algorithm), with ``auto``'s choice marked.
    """
    chosen = select.choose(nbytes, p, path=path) if p > 1 else None
    local = p if local_size is None else max(1, min(local_size, p))
    lines = [f"allreduce of {nbytes} bytes on {p} ranks ({math.ceil(p / local)} node(s) of up to {local}): "
             "predicted time per algorithm",
             f"  {'algorithm':<13}{'time (us)':>12}   note"]
    rows = predictions(nbytes, p, local_size=local_size, path=path)
    for name, (seconds, note) in sorted(rows.items(), key=lambda kv: kv[1][0]):
        mark = "  <- auto" if name == chosen else ""
        lines.append(f"  {name:<13}{seconds * 1e6:>12.1f}   {note}{mark}")
    return "\n".join(lines)
