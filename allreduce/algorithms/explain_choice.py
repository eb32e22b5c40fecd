"""Why ``algorithm="auto"`` picks what it picks: every algorithm's predicted time, side by side.

::

    >>> from allreduce.algorithms.explain_choice import explain_choice
    >>> print(explain_choice(64 << 20, 2))
    allreduce of 64 MiB on 2 ranks (1 node of 2): predicted time per algorithm
      algorithm     time (us)   a*alpha    b*n*beta   g*n*gamma   note
      ring           ...

Every algorithm, ``shm`` included, uses the constants of :mod:`.select`
(fitted per machine by ``benchmarks/fit_costmodel.py``), except where the
measured table covers this world size: then the candidates show the
measured times ``auto`` decided by. ``shm`` sends no
messages, so its "alpha" is one flag hand-off per window and its "gamma" the
memory traffic; ``hierarchical`` is ``shm`` inside a node plus a ring across
nodes on n/L bytes. ``auto``'s choice is marked ``<- auto``.
"""
from __future__ import annotations

import math

from . import select

__all__ = ["predictions", "explain_choice"]

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
        if name == "shm" and nodes > 1:
            continue
        note = "syncs + bytes moved, fitted" if name == "shm" else "alpha-beta-gamma, fitted"
        out[name] = (select.predict(name, nbytes, p, path=path), note)
    cross = select.predict("ring", math.ceil(nbytes / local), nodes, path=path) if nodes > 1 else 0.0
    out["hierarchical"] = (select.predict("shm", nbytes, local, path=path) + cross,
                           f"shm in {nodes} node(s) of {local} + ring across nodes on n/{local}")
    return out


def explain_choice(nbytes: int, p: int, *, local_size: int | None = None, path: str = "",
                   candidates: tuple[str, ...] = ("ring", "tree", "rhd", "rd"), nodes: int = 1,
                   link=None) -> str:
    """A table of every algorithm's predicted time for one allreduce, fastest first.

    Args:
        nbytes: message size in bytes.
        p: number of ranks.
        local_size: ranks per node (default: all ``p`` on one node).
        path: fitted cost-model file ("" = the per-machine cache).
        candidates: what ``auto`` chooses among (``Communicator.auto_candidates``).

        nodes, link: real nodes and their :class:`~.network.Link` (a job across nodes: the
            network model of :mod:`.network` decides, as ``auto`` does there).

    Returns:
        The table as text (one line per algorithm), with ``auto``'s choice marked.
    """
    if link is not None and nodes > 1:
        return _across_nodes(nbytes, p, nodes, link, path, candidates)
    chosen = select.choose(nbytes, p, candidates=candidates, path=path) if p > 1 else None
    local = p if local_size is None else max(1, min(local_size, p))
    lines = [f"allreduce of {nbytes} bytes on {p} ranks ({math.ceil(p / local)} node(s) of up to {local}): "
             "predicted time per algorithm",
             f"  (numbers from {select.source(path)})",
             f"  {'algorithm':<13}{'time (us)':>12}   note"]
    rows = predictions(nbytes, p, local_size=local_size, path=path)
    measured = select.measured_times(nbytes, p, tuple(candidates), path=path) if p > 1 else None
    for name, seconds in (measured or {}).items():       # what auto decided by, where it was measured
        rows[name] = (seconds, "measured at this p, interpolated in log(size)")
    for name, (seconds, note) in sorted(rows.items(), key=lambda kv: kv[1][0]):
        mark = "  <- auto" if name == chosen else ""
        lines.append(f"  {name:<13}{seconds * 1e6:>12.1f}   {note}{mark}")
    return "\n".join(lines)


def _across_nodes(nbytes: int, p: int, nodes: int, link, path: str, candidates: tuple[str, ...]) -> str:
    """The table for a job across ``nodes`` real nodes: each candidate's network-model time and its
    link terms (:mod:`.network`)."""
    from . import network
    rows = network.ranked(nbytes, p, nodes, link, candidates=candidates, path=path)
    lines = [f"allreduce of {nbytes} bytes on {p} ranks across {nodes} nodes, link {link}: predicted time "
             "per algorithm (its single-node model + messages and bytes through one host's link)",
             f"  {'algorithm':<13}{'time (us)':>12}   messages / bytes per byte across the link"]
    for i, (name, seconds) in enumerate(rows):
        a, b = network.cross_terms(name, p, nodes, nbytes)
        lines.append(f"  {name:<13}{seconds * 1e6:>12.1f}   {a:g} / {b:.3g}{'  <- auto' if i == 0 else ''}")
    return "\n".join(lines)
