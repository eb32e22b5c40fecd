"""``auto`` across nodes: the link between hosts, and what each algorithm sends across it.

On one node the wire is memory and :mod:`.select` prices every algorithm from
a table measured there. Across nodes every algorithm also pays the network,
which that table knows nothing about (issue 26: at 2 hosts x 2 ranks on a
1 Gbit/s link, 16 MiB took 436 ms hierarchical and 480 ms ring, where one
node's table predicts a few milliseconds). So a job whose ranks span
N > 1 nodes (MPI's real placement, ``COMM_TYPE_SHARED``) prices each
candidate as

    T(n) = T_node(n)  +  a_net * alpha_link  +  b_net * n * beta_link

* ``T_node``: the algorithm's single-node model (:func:`.select.predict`):
  Python and memory costs, still paid;
* ``alpha_link``: half a round trip between two hosts; ``beta_link``:
  seconds per byte through one host's link (1 / its rate);
* ``a_net``: messages across the link on the critical path;
* ``b_net``: bytes one host sends through its link per byte of input, its
  L ranks together (consecutive placement, L = p / N ranks per host)::

      ring           2(p-1)/p        one edge of the ring leaves each host
      mpi            2(p-1)/p        Open MPI's large-message allreduce is a ring
      rhd            2 L (N-1)/N     steps of mask >= L cross: n/2 + n/4 + ... per rank, twice
      rd             L log2 N        the log2 N crossing steps send all n, from every rank
      tree           2               a host's partial sums go up, the result comes down
      hierarchical   2(N-1)/N        shm inside, ring across: each byte crosses once per node

  At 2 hosts x 2 ranks: hierarchical 1, ring and mpi 1.5, rhd and tree 2,
  rd 2: the cap of 1.5x hierarchical over ring that the issue states.

The constants come from :class:`Link`: ``ALLREDUCE_LINK`` ("10gbit",
"0.96gbit,31us") when set, else :func:`probe`, run once by ``ar.init()`` when
the job spans nodes: round trips of 8 bytes, 1 MiB and 4 MiB between the
first two nodes through the transport the algorithms use (about 0.2 s at
1 Gbit/s). The model ranks; the
run-time tuner (:mod:`allreduce.autotune`) then times the best few on the
first calls of each size and keeps the fastest, as on one node.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import numpy as np

from . import select, shm
from .broadcast import broadcast

__all__ = ["Link", "parse_link", "probe", "cross_terms", "predict", "ranked", "NET_ALGORITHMS"]

#: Algorithms with a network model (``shm`` needs one node).
NET_ALGORITHMS = ("ring", "tree", "rhd", "rd", "mpi", "hierarchical")
_PINGS, _BIG, _REPEATS = 20, 1 << 20, 2
_MAX_BIG, _MIN_ONE_WAY = 16 << 20, 2.5e-3   # the probe's largest m; one way of m must take this long
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


@dataclass(frozen=True)
class Link:
    """One host's link: ``alpha`` seconds per message (half a round trip), ``beta`` seconds per byte."""

    alpha: float
    beta: float
    source: str = "configured"       #: "configured" (ALLREDUCE_LINK) or "measured" (probe)

    def __str__(self) -> str:
        rate = 8 / self.beta / 1e9 if self.beta > 0 else float("inf")
        return f"{rate:.3g} Gbit/s, {self.alpha * 1e6:.0f} us per message ({self.source})"


def parse_link(text: str) -> Link:
    """``ALLREDUCE_LINK``: a rate as tc writes it, optionally a latency: ``10gbit``, ``0.96gbit,31us``.

    Without a latency, 25 us (half a TCP round trip on a quiet Ethernet LAN).
    """
    rate, _, latency = text.strip().lower().partition(",")
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)bit", rate.strip())
    lat = re.fullmatch(r"([0-9.]+)\s*(us|ms|s)", latency.strip()) if latency else None
    if m is None or (latency and lat is None) or float(m.group(1)) <= 0:
        raise ValueError(f"ALLREDUCE_LINK={text!r}: write a rate and optionally a per-message latency, "
                         "e.g. 10gbit or 0.96gbit,31us")
    beta = 8 / (float(m.group(1)) * _UNITS[m.group(2)])
    alpha = float(lat.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[lat.group(2)] if lat else 25e-6
    return Link(alpha, beta, "configured")


def probe(transport, node_ids: list[int]) -> Link:
    """Measure the link between the first two nodes (collective over ``transport``: every rank calls it).

    Steps: 1. rank 0 and the lowest rank of another node swap 8 bytes ``_PINGS`` times (median
    round trip / 2 = alpha); 2. they swap m and 4m bytes, best of ``_REPEATS`` round trips each,
    and beta is the slope between the two, so a fixed cost per message cancels out; 3. rank 0
    broadcasts both. Everyone else waits in step 3.

    The slope is the link's rate only if *both* sizes exceed what a token bucket lets through
    unshaped (tbf's burst: 512 KiB, or 2 ms of rate, on the namespace cluster): the bytes of the
    burst then cancel too. m starts at 1 MiB and grows 4x while one way of an m round trip took
    under ``_MIN_ONE_WAY`` (2.5 ms: more than such a burst takes at the rate), up to 16 MiB. Before
    this rule m was always 1 MiB: at 10 Gbit/s (a 2.5 MB burst) the 1 MiB round trip went through
    the burst entirely and the 4 MiB one mostly, and the slope read 18.2 Gbit/s on a link whose
    TCP stream carried 6.8 (issue 34). At 1 Gbit/s m stays 1 MiB (above the 512 KiB burst).
    Nor may beta promise a faster rate than the 4m round trip achieved on average (burst and all).
    """
    peer = next(r for r, node in enumerate(node_ids) if node != node_ids[0])
    out = np.zeros(2, np.float64)
    me = transport.rank
    if me in (0, peer):
        other = peer if me == 0 else 0
        ping = np.zeros(1, np.float64)
        rtts = [_round_trip(transport, ping, other, me == 0) for _ in range(_PINGS + 1)][1:]
        alpha = sorted(rtts)[len(rtts) // 2] / 2
        size, t1 = _BIG, _best_round_trip(transport, _BIG, other, me == 0)
        while size < _MAX_BIG and _bigger(transport, t1 / 2 < _MIN_ONE_WAY, other, me == 0):
            size, t1 = 4 * size, _best_round_trip(transport, 4 * size, other, me == 0)
        t4 = _best_round_trip(transport, 4 * size, other, me == 0)
        # the slope, but never a faster rate than the 4m round trip's own average: the slope is a
        # difference of two noisy times, and under load it once read 4.8 Gbit/s on a 1 Gbit/s link
        out[:] = alpha, max((t4 - t1) / (2 * 3 * size), t4 / (2 * 4 * size))
    broadcast(transport, out, 0)
    return Link(float(out[0]), float(out[1]), "measured")


def _best_round_trip(transport, nbytes: int, other: int, first: bool) -> float:
    buf = np.zeros(nbytes // 8)
    return min(_round_trip(transport, buf, other, first) for _ in range(_REPEATS))


def _bigger(transport, mine: bool, other: int, first: bool) -> bool:
    """Both ends take the first side's answer (they timed the same round trips, each its own way)."""
    flag = np.array([1.0 if mine else 0.0])
    if first:
        transport.send(flag, other)
    else:
        transport.recv(flag, other)
    return bool(flag[0])


def _round_trip(transport, buf: np.ndarray, other: int, first: bool) -> float:
    """Seconds for ``buf`` to go to ``other`` and back (the side that sends first times it)."""
    t = time.perf_counter()
    if first:
        transport.send(buf, other)
        transport.recv(buf, other)
    else:
        transport.recv(buf, other)
        transport.send(buf, other)
    return time.perf_counter() - t


def cross_terms(algorithm: str, p: int, nodes: int, nbytes: int = 0) -> tuple[float, float]:
    """``(a_net, b_net)``: messages across a host's link on the critical path, and bytes through it per
    byte of input, for ``algorithm`` on ``p`` ranks over ``nodes`` hosts (the module's table)."""
    if nodes <= 1 or p <= 1:
        return 0.0, 0.0
    local = p / nodes
    steps = math.ceil(math.log2(nodes))
    if algorithm in ("ring", "mpi"):
        lat = 2 * (p - 1) if algorithm == "ring" else 2 * steps
        return lat, 2 * (p - 1) / p
    if algorithm == "rhd":
        return 2 * steps, 2 * local * (nodes - 1) / nodes
    if algorithm == "rd":
        return steps, local * steps
    if algorithm == "tree":
        return select.terms("tree", p, nbytes or None)[0], 2.0
    if algorithm == "hierarchical":
        windows = max(1, math.ceil(nbytes / shm.SLOT_BYTES))
        return 2 * (nodes - 1) * windows, 2 * (nodes - 1) / nodes
    raise ValueError(f"no network model for algorithm {algorithm!r}")


def predict(algorithm: str, nbytes: int, p: int, nodes: int, link: Link, *, path: str = "") -> float:
    """Predicted seconds of one allreduce of ``nbytes`` on ``p`` ranks over ``nodes`` hosts."""
    if algorithm == "hierarchical":
        local = math.ceil(p / nodes)
        node = select.predict("shm", nbytes, local, path=path) + select.predict(
            "ring", math.ceil(nbytes / local), nodes, path=path)
    else:
        node = select.predict(algorithm, nbytes, p, path=path)
    a, b = cross_terms(algorithm, p, nodes, nbytes)
    return node + a * link.alpha + b * nbytes * link.beta


def ranked(nbytes: int, p: int, nodes: int, link: Link, *, candidates=NET_ALGORITHMS,
           path: str = "") -> list[tuple[str, float]]:
    """Every candidate with its predicted seconds across nodes, fastest first (ties: the earlier name)."""
    times = [(name, predict(name, nbytes, p, nodes, link, path=path)) for name in candidates]
    return sorted(times, key=lambda kv: kv[1])
