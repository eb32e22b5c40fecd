"""Shared by every benchmark: sizes, bandwidth arithmetic, the machine, tables and JSON.

The tables follow nccl-tests (``all_reduce_perf``) and the definitions of its
PERFORMANCE.md, so a performance engineer can read them without a legend:

* ``algbw = S / t`` with S the collective's size in bytes (for allgather and
  reducescatter, the full buffer: p times one rank's part);
* ``busbw = algbw * factor``: the bandwidth each link would need if the
  collective were done optimally, comparable across rank counts:
  allreduce ``2(p-1)/p``, reducescatter and allgather ``(p-1)/p``, broadcast 1.

GB means 1e9 bytes, as in nccl-tests. Sizes on the command line take K/M/G
suffixes in powers of 1024 (``-b 8 -e 64M``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shlex
import socket
import sys
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["COLLECTIVES", "OP_NAMES", "parse_size", "size_list", "human_size", "bus_factor", "bandwidths",
           "Row", "table_header", "format_row", "osu_header", "format_osu", "parse_table", "parse_osu",
           "machine_description", "machine_header", "command_line", "write_json", "dtype_from_name",
           "note"]

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reducescatter")
OP_NAMES = ("sum", "avg", "min", "max", "prod")

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864. Accepts an integer with an optional K, M or G (also KB, KiB...).

    Args:
        text: the size as typed on the command line.

    Returns:
        The size in bytes.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"bad size {text!r}: use an integer with an optional K, M or G suffix, e.g. 8, 4K, 64M")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]


def size_list(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """Sizes ``min, min*f, min*f^2, ...`` up to and including ``max`` (nccl-tests' -b/-e/-f)."""
    if minbytes <= 0 or maxbytes < minbytes:
        raise ValueError(f"need 0 < min size <= max size, got {minbytes} and {maxbytes}")
    if factor <= 1:
        raise ValueError(f"step factor must be > 1, got {factor}")
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(int(size))
        size = max(int(size * factor), int(size) + 1)
    return sizes


def human_size(nbytes: int) -> str:
    """67108864 -> ``"64 MiB"`` (exact powers only get a suffix)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``collective`` on ``p`` ranks."""
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "reducescatter"):
        return (p - 1) / p
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")


def bandwidths(size_bytes: int, seconds: float, collective: str, p: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes) of one collective of ``size_bytes`` taking ``seconds``."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(collective, p)


def dtype_from_name(name: str) -> np.dtype:
    """``"bfloat16"`` -> the ml_dtypes dtype; other names as numpy spells them."""
    if name == "bfloat16":
        from allreduce.ops import bfloat16
        return bfloat16
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}; try float32, float16, bfloat16, float64, int32") from None


@dataclasses.dataclass
class Row:
    """One line of the table: one size, one algorithm."""

    collective: str
    size_bytes: int
    count: int
    dtype: str
    op: str
    algorithm: str
    ranks: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None = None        # None: not checked (-c not given)
    min_us: float = 0.0             # min over ranks of the per-rank average
    avg_us: float = 0.0             # mean over ranks of the per-rank average
    max_us: float = 0.0             # = time_us (nccl-tests and OSU report the slowest rank)
    iters: int = 0
    bound_frac: float | None = None  # algbw / physical bound (allreduce only)

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# (name, unit, width); cells are joined with one space, so a long value never fuses with its neighbour.
_COLUMNS = (("size", "(B)", 11), ("count", "(elements)", 11), ("type", "", 8), ("redop", "", 5),
            ("algorithm", "", 12), ("time", "(us)", 10), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7),
            ("#wrong", "", 6), ("%bound", "", 6))


def table_header() -> list[str]:
    """The two '#' header lines of the table."""
    names = "#" + " ".join(f"{n:>{w}}" for n, _, w in _COLUMNS)
    units = "#" + " ".join(f"{u:>{w}}" for _, u, w in _COLUMNS)
    return [names, units]


def format_row(row: Row) -> str:
    """One table line; ``#wrong`` is N/A when unchecked, ``%bound`` '-' when there is no bound."""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    bound = "-" if row.bound_frac is None else f"{100 * row.bound_frac:.1f}"
    cells = (row.size_bytes, row.count, row.dtype, row.op, row.algorithm, f"{row.time_us:.2f}",
             f"{row.algbw_gbps:.3f}", f"{row.busbw_gbps:.3f}", wrong, bound)
    return " " + " ".join(f"{c:>{w}}" for c, (_, _, w) in zip(cells, _COLUMNS))


def parse_table(text: str) -> list[dict[str, Any]]:
    """The data rows of a printed table (lines not starting with '#'), as dicts."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if not parts or line.lstrip().startswith("#") or len(parts) != len(_COLUMNS):
            continue
        size, count, dtype, op, algo, time, algbw, busbw, wrong, bound = parts
        rows.append({"size_bytes": int(size), "count": int(count), "dtype": dtype, "op": op, "algorithm": algo,
                     "time_us": float(time), "algbw_gbps": float(algbw), "busbw_gbps": float(busbw),
                     "wrong": None if wrong == "N/A" else int(wrong),
                     "bound_pct": None if bound == "-" else float(bound)})
    return rows


def osu_header(collective: str, algorithm: str) -> list[str]:
    """OSU micro-benchmarks' header for one block (osu_allreduce and friends)."""
    title = {"allreduce": "Allreduce", "broadcast": "Broadcast", "allgather": "Allgather",
             "reducescatter": "Reduce_scatter"}[collective]
    return [f"# OSU MPI {title} Latency Test (allreduce benchmarks, algorithm {algorithm})",
            f"# {'Size':<10}{'Avg Latency(us)':>18}{'Min Latency(us)':>18}{'Max Latency(us)':>18}"
            f"{'Iterations':>12}"]


def format_osu(row: Row) -> str:
    """One OSU line: size, then avg/min/max over ranks of each rank's mean latency."""
    return f"{row.size_bytes:<12}{row.avg_us:>18.2f}{row.min_us:>18.2f}{row.max_us:>18.2f}{row.iters:>12}"


def parse_osu(text: str) -> dict[str, list[dict[str, float]]]:
    """OSU output -> {algorithm: [{size, avg_us, min_us, max_us, iters}, ...]}."""
    blocks: dict[str, list[dict[str, float]]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"# OSU MPI .* Latency Test .*algorithm (\S+)\)", line)
        if match:
            current = blocks.setdefault(match.group(1), [])
            continue
        parts = line.split()
        if current is None or not parts or line.startswith("#") or len(parts) != 5:
            continue
        current.append({"size": int(parts[0]), "avg_us": float(parts[1]), "min_us": float(parts[2]),
                        "max_us": float(parts[3]), "iters": int(parts[4])})
    return blocks


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


def machine_description() -> dict[str, Any]:
    """CPU, cores, memory, MPI library, Python and numpy versions of this machine."""
    desc: dict[str, Any] = {"host": socket.gethostname(), "cpu": _cpu_model(), "cores": os.cpu_count(),
                            "memory_gib": round(_memory_gib(), 1), "os": platform.platform(),
                            "python": platform.python_version(), "numpy": np.__version__}
    try:
        import mpi4py
        from mpi4py import MPI
        desc["mpi"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
        desc["mpi4py"] = mpi4py.__version__
    except ImportError:
        desc["mpi"] = "mpi4py not importable"
    if hasattr(os, "sched_getaffinity"):   # mpirun --bind-to core leaves one core here; none, all of them
        desc["affinity"] = sorted(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):      # other jobs on the box skew every timing; say so
        desc["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    from importlib import metadata
    for package in ("numba", "torch", "horovod"):      # versions without importing (torch takes seconds)
        try:
            desc[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return desc


def machine_header(desc: dict[str, Any]) -> list[str]:
    """The machine description as '#' lines."""
    load = f", load average {' '.join(map(str, desc['loadavg']))} at start" if "loadavg" in desc else ""
    cpus = desc.get("affinity")
    if cpus is not None:
        load += (f"; this rank bound to core {cpus[0]}" if len(cpus) == 1 else
                 f"; this rank free to run on {len(cpus)} cores" if len(cpus) == desc["cores"] else
                 f"; this rank bound to cores {','.join(map(str, cpus))}")
    lines = [f"# host {desc['host']}: {desc['cpu']}, {desc['cores']} cores, {desc['memory_gib']} GiB{load}",
             f"# {desc.get('mpi', '?')} | mpi4py {desc.get('mpi4py', '-')}",
             f"# python {desc['python']}, numpy {desc['numpy']}"
             + "".join(f", {m} {desc[m]}" for m in ("numba", "torch", "horovod") if m in desc)]
    return lines


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that is running, as a user would retype it (with the launcher if known).

    The launcher is spelled ``allreduce-run``: it passes mpirun's flags through and adds the
    root and oversubscribe ones, so the printed command also runs as root (bare mpirun refuses)."""
    argv = sys.argv if argv is None else argv
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    # Settings that change what is measured: our own (allreduce.config's variables) and the MPI transport chosen
    # with mpirun --mca (which Open MPI hands to the ranks as OMPI_MCA_<name>).
    from allreduce.config import ENV_VARIABLES, OPEN_MPI_DEFAULTS
    env = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in ENV_VARIABLES if k in os.environ)
    mca = "".join(f"--mca {name} {shlex.quote(os.environ['OMPI_MCA_' + name])} " for name in _SHOWN_MCA
                  if "OMPI_MCA_" + name in os.environ     # and not allreduce's own default: no user's choice
                  and os.environ["OMPI_MCA_" + name] != OPEN_MPI_DEFAULTS.get("OMPI_MCA_" + name))
    launcher = f"allreduce-run {mca}-np {size} " if size else ""     # runs as root too (docs/README.md)
    return env + launcher + "python " + " ".join(shlex.quote(a) for a in argv)


_SHOWN_MCA = ("btl", "pml", "coll", "osc")


def write_json(path: str, payload: dict[str, Any], records: Iterable[dict[str, Any]]) -> None:
    """``payload`` (command, machine, ...) plus ``records`` under "records", as indented JSON."""
    data = dict(payload)
    data["records"] = list(records)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def note(text: str) -> str:
    """A '#' note line (skipped peers, the metadata check cost, the bound)."""
    return f"# {text}"
