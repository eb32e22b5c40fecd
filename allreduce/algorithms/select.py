"""``algorithm="auto"``: predict each algorithm's time and take the fastest.

Every algorithm's time is modelled in the alpha-beta-gamma form

    T(n, p) = a(p) * alpha + b(p) * n * beta + g(p) * n * gamma

where n is the message in bytes, ``a`` counts the message latencies on the
critical path, ``b`` the bytes each rank sends per byte of input and ``g``
the bytes it reduces. The counts come from each algorithm's docstring; the
constants (alpha, beta, gamma) are per algorithm, because a Python-level
message costs more than one inside MPI.

The constants live in one place: ``DEFAULTS`` below, overridden by the file
``benchmarks/fit_costmodel.py`` writes from a real run on this machine
(``~/.cache/allreduce/costmodel-<host>.json``, or ``ALLREDUCE_COSTMODEL``).

That file also keeps the measured times themselves, per world size (and,
from ``allreduce_bench.py --cold`` runs, with a cold cache: the engine's
choice, see :func:`measured_times`). With
no per-machine file, the measured table shipped with the package
(``costmodel_builtin.json``: the BENCHMARKS.md run on the 2-core VM,
written by ``fit_costmodel.py --builtin``) stands in for it; an explicit
``path`` (``ALLREDUCE_COSTMODEL``) never falls back to it. For a
world size it has, ``choose`` goes by them (interpolated between the two
measured sizes around n) rather than by the straight lines: caches make
real times bend (native MPI here is the fastest up to 4 MiB and the slowest
at 64 MiB), which no alpha-beta-gamma line follows. Every rank must read the
same file, as every rank must choose the same algorithm: on one node they do.
(Interpolation is in log(time) over log(size): times grow as a power of n.)
"""
from __future__ import annotations

import json
import math
import socket
from functools import lru_cache
from pathlib import Path

from ..transport import shared
from . import shm

__all__ = ["choose", "ranked", "predict", "terms", "constants", "measured_times", "source", "DEFAULTS", "default_path",
           "BUILTIN"]

# Seconds per message (alpha), per byte sent (beta), per byte reduced (gamma).
# Fitted by benchmarks/fit_costmodel.py from the BENCHMARKS.md run (-np 2 and 4,
# 16 B..64 MiB) on a 2-core x86-64 VM with shared-memory Open MPI 5; gamma is the
# measured reduction kernel. Refit on your machine: the fit goes to default_path().
DEFAULTS: dict[str, dict[str, float]] = {
    "ring": {"alpha": 36e-6, "beta": 0.39e-9, "gamma": 0.12e-9},
    "tree": {"alpha": 40e-6, "beta": 0.61e-9, "gamma": 0.12e-9},
    "rhd":  {"alpha": 22e-6, "beta": 0.50e-9, "gamma": 0.12e-9},
    "rd":   {"alpha": 30e-6, "beta": 0.67e-9, "gamma": 0.12e-9},
    "mpi":  {"alpha": 9.6e-6, "beta": 0.47e-9, "gamma": 0.12e-9},
    # shm sends no messages: alpha is one flag hand-off, gamma the memory traffic per byte.
    "shm":  {"alpha": 15e-6, "beta": 0.0,     "gamma": 0.12e-9},
}



def _tree_hops(p: int) -> int:
    """Messages on the double tree's critical path with one segment (see :mod:`.tree`).

    D = depth. The root's partial sum goes to its partner at once (even p: it has no other
    child) or after one hop (odd p: rank p - 1 hangs under it too), while the partner's
    subtree reduces in D - 1 hops; the partner finishes and sends down D - 1 hops, and the
    root finishes when the partner's sum arrives (hop D) and, for odd p, sends it to p - 1.
    At p = 3 both top edges join ranks 0 and 1, and each waits for both swaps before it
    forwards to rank 2: one hop more."""
    if p == 3:
        return 3
    depth = math.ceil(math.log2(p if p % 2 == 0 else max(p - 1, 1))) if p > 2 else 1
    if p % 2 == 0:
        return max(depth, 2 * (depth - 1))
    return max(depth + 1, max(2, depth - 1) + depth - 1)


def terms(algorithm: str, p: int, nbytes: int | None = None,
          segment_bytes: int = 256 << 10) -> tuple[float, float, float]:
    """``(a, b, g)``: latency count and per-byte send/reduce factors of ``algorithm`` on p ranks.

    Only ``tree`` and ``shm`` depend on the message size. ``tree``: its pipeline of S
    segments per half adds a stage up and one down to the one-segment path's H hops, so
    a = H + 2(S - 1). The bytes: each rank sends 2n in all (n/2 up and n down in the
    tree where it is interior, n/2 up in the other), and the critical path is a stages
    of one segment of one tree, n/(2S) each; the larger of the two bounds the time, so
    b = 2 max(1, a/(4S)) and g = 1.5 max(1, a/(4S)). At p = 8 and one segment (H = 4):
    4 alpha + 2 n beta + 1.5 n gamma, as ``allreduce-explain tree --ranks 8`` counts.
    (p = 2 is one swap per segment: a = b = 2S - 1 over S.) Without ``nbytes``: the
    long-message limit (S >> H), H alpha + 2 n beta + 1.5 n gamma. ``shm`` counts its windows
    (:func:`allreduce.transport.shared.window_bytes`: 2 MiB, or 4 MiB with more ranks than
    cores).
    """
    if p <= 1:
        return 0.0, 0.0, 0.0
    lg = math.ceil(math.log2(p))
    pow2 = 1 << int(math.log2(p))
    extra = 0 if pow2 == p else 2      # non-powers of two fold in, then out
    if algorithm == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p, (p - 1) / p
    if algorithm == "rhd":
        return 2 * int(math.log2(pow2)) + extra, 2 * (pow2 - 1) / pow2 + extra, (pow2 - 1) / pow2 + extra / 2
    if algorithm == "rd":
        return int(math.log2(pow2)) + extra, int(math.log2(pow2)) + extra, int(math.log2(pow2)) + extra / 2
    if algorithm == "tree":
        hops, g1 = _tree_hops(p), (1.0 if p == 2 else 1.5)
        if nbytes is None:
            return hops, 2.0, g1
        s = max(1, math.ceil(nbytes / (2 * segment_bytes))) if segment_bytes > 0 else 1
        stages = hops + 2 * (s - 1)        # each further segment adds one stage up and one down
        if p == 2:                         # one swap of a whole segment per stage
            return stages, stages / s, g1 * max(1.0, stages / 2) / s
        fill = max(1.0, stages / (4 * s))  # the critical path's bytes, when they exceed 2n
        return stages, 2.0 * fill, g1 * fill
    if algorithm == "mpi":
        return 2 * lg, 2 * (p - 1) / p, (p - 1) / p
    if algorithm == "shm":
        # Two flag hand-offs per window; each rank reads and writes shm.traffic(p) bytes per byte.
        windows = max(1, math.ceil((nbytes or 0) / shared.window_bytes(p)))
        return 2 * windows, 0.0, shm.traffic(p)
    raise ValueError(f"no cost model for algorithm {algorithm!r}")


#: The measured table shipped with the package: used when there is no per-machine file.
BUILTIN = Path(__file__).with_name("costmodel_builtin.json")


def default_path() -> Path:
    return Path.home() / ".cache" / "allreduce" / f"costmodel-{socket.gethostname()}.json"


def clear_cache() -> None:
    """Forget cached constants and choices (after changing HOME or a cost-model file in a test)."""
    _read.cache_clear()
    _load.cache_clear()
    _choose.cache_clear()


def _stamp(path: str) -> tuple[str, int | None]:
    """The file the constants come from, and its modification time (None: no file): the cache key,
    so a new fit is read on the next call. (Communicators remember their choices themselves.)
    Without ``path`` and without a per-machine file, the package's built-in table."""
    files = [Path(path)] if path else [default_path(), BUILTIN]
    for file in files:
        try:
            return str(file), file.stat().st_mtime_ns
        except OSError:
            continue
    return str(files[0]), None


def source(path: str = "") -> str:
    """Where ``auto``'s numbers come from: the file read, or the built-in constants."""
    file, mtime = _stamp(path)
    if mtime is None:
        return "the built-in constants (select.DEFAULTS); no cost-model file"
    return f"{'the built-in table ' if Path(file) == BUILTIN else ''}{file}"


@lru_cache(maxsize=8)
def _read(file: str, mtime: int | None) -> dict:
    if mtime is None:
        return {}
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@lru_cache(maxsize=8)
def _load(file: str, mtime: int | None) -> dict[str, dict[str, float]]:
    table = {k: dict(v) for k, v in DEFAULTS.items()}
    if mtime is not None:
        fitted = _read(file, mtime).get("constants", {})
        for name, values in fitted.items():
            if name in table:
                table[name].update({k: float(v) for k, v in values.items() if k in ("alpha", "beta", "gamma")})
    return table


def constants(path: str = "") -> dict[str, dict[str, float]]:
    """DEFAULTS updated with the fitted constants at ``path`` (or the per-machine cache).

    The file is read again only when its modification time changes.
    """
    return {k: dict(v) for k, v in _load(*_stamp(path)).items()}


def predict(algorithm: str, nbytes: int, p: int, *, path: str = "") -> float:
    """Predicted seconds for one allreduce of ``nbytes`` on ``p`` ranks."""
    return _predict(algorithm, nbytes, p, _load(*_stamp(path)))


def _predict(algorithm: str, nbytes: int, p: int, table: dict) -> float:
    c = table[algorithm]
    a, b, g = terms(algorithm, p, nbytes)
    return a * c["alpha"] + b * nbytes * c["beta"] + g * nbytes * c["gamma"]


def choose(nbytes: int, p: int, *, candidates=("ring", "tree", "rhd", "rd"), path: str = "",
           cold: bool = False) -> str:
    """The candidate with the smallest predicted time (ties go to the earlier name).

    ``Communicator.auto_candidates`` adds ``mpi`` on the MPI transport and
    ``shm`` when every rank shares one node. Answers are cached per size and
    constants file: the engine and the blocking path
    ask for every allreduce, and evaluating the model costs tens of microseconds.
    """
    return _choose(nbytes, p, tuple(candidates), _stamp(path), cold)


@lru_cache(maxsize=4096)
def _choose(nbytes: int, p: int, candidates: tuple[str, ...], stamp: tuple[str, int | None], cold: bool) -> str:
    return _ranked(nbytes, p, candidates, stamp, cold)[0][0]


def ranked(nbytes: int, p: int, *, candidates=("ring", "tree", "rhd", "rd"), path: str = "",
           cold: bool = False) -> list[tuple[str, float]]:
    """Every candidate with its predicted seconds, fastest first (ties: the earlier name); the
    first is :func:`choose`'s answer. The run-time tuner (:mod:`allreduce.autotune`) times the
    top few."""
    return _ranked(nbytes, p, tuple(candidates), _stamp(path), cold)


def _ranked(nbytes: int, p: int, candidates: tuple[str, ...], stamp: tuple[str, int | None],
            cold: bool) -> list[tuple[str, float]]:
    times = measured_times(nbytes, p, candidates, stamp=stamp, cold=cold)
    if times is None:
        table = _load(*stamp)
        times = {name: _predict(name, nbytes, p, table) for name in candidates}
    return sorted(((name, times[name]) for name in candidates), key=lambda kv: kv[1])   # stable


def measured_times(nbytes: int, p: int, candidates: tuple[str, ...], *, path: str = "", cold: bool = False,
                   stamp: tuple[str, int | None] | None = None) -> dict[str, float] | None:
    """Seconds per candidate from a benchmark of this world size on this machine (interpolated), or
    None when ``p`` or a candidate was not measured: then the model decides.

    ``cold``: prefer the table measured with a cold cache (``allreduce_bench.py --cold``), where it
    covers ``nbytes``: the engine's tensors are gradients, written by a backward pass over a model
    larger than the cache, while a benchmark loop (and nccl-tests) reuses one warm buffer. On the
    2-core VM the two disagree: native MPI is the fastest at 4 MiB warm, and shm, cold, reduced
    ResNet-50's gradients through the engine in 24 ms against native's 30 (by hand).
    """
    data = _read(*(stamp or _stamp(path)))
    if cold:
        times = _measured_times(nbytes, p, tuple(candidates), data.get("measured_cold", {}), within=True)
        if times is not None:
            return times
    return _measured_times(nbytes, p, tuple(candidates), data.get("measured", {}))


def _measured_times(nbytes: int, p: int, candidates: tuple[str, ...], measured: dict,
                    within: bool = False) -> dict[str, float] | None:
    """Each candidate's time, interpolating its log(time) linearly in log(size) between the two
    measured sizes around ``nbytes`` (the nearest measured size outside the range; ``within``:
    None outside the measured range instead)."""
    rows = measured.get(str(p)) if isinstance(measured, dict) else None
    if not rows:
        return None
    sizes = [int(size) for size, _ in rows]
    if within and not sizes[0] <= nbytes <= sizes[-1]:
        return None
    x = math.log2(max(nbytes, 1))
    hi = next((i for i, size in enumerate(sizes) if size >= nbytes), len(sizes) - 1)
    lo = max(hi - 1, 0) if sizes[hi] > nbytes else hi
    xs = [math.log2(max(sizes[lo], 1)), math.log2(max(sizes[hi], 1))]
    w = 0.0 if xs[1] == xs[0] else min(max((x - xs[0]) / (xs[1] - xs[0]), 0.0), 1.0)
    times = {}
    for name in candidates:
        if name not in rows[lo][1] or name not in rows[hi][1]:
            return None
        t0, t1 = max(float(rows[lo][1][name]), 1e-9), max(float(rows[hi][1][name]), 1e-9)
        times[name] = t0 ** (1 - w) * t1 ** w * 1e-6      # a power law between the two sizes (us -> s)
    return times
