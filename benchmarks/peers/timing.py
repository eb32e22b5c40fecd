"""What the peer comparison measures, how it times it, and its table: shared by both venvs.

This file imports numpy and the standard library only: ``peers/ours_bench.py`` runs it
in the project's venv (TF 2.21, torch for Gloo) and ``peers/horovod_bench.py`` in
``.venv-horovod`` (TF 2.12, Horovod 0.28.1), where the project is not installed.

=========  ==================================================================
measure    what one timed call is
=========  ==================================================================
latency    one named 4 KiB float32 tensor, averaged over the ranks
grouped    1000 tensors of 4 KiB in one grouped call (Gloo: 1000 async calls,
           then wait: torch.distributed has no grouped allreduce)
busbw      one tensor, 1 KiB to 64 MiB by 4x: nccl-tests' busbw = 2(p-1)/p * S/t
=========  ==================================================================

Timing, as in ``benchmarks/engine_bench.py``: warm up, then ``repeats`` blocks of
``iters`` calls, the variants round-robin within a launch (a barrier before each block);
a row is the slowest rank's mean of its fastest block. Launches alternate (ours, Gloo,
Horovod, ours, ...) and a row keeps its fastest launch (:func:`best_of`).
"""
from __future__ import annotations

import json
import time
from typing import Callable

__all__ = ["SMALL", "GROUPED", "SIZES", "MEASURES", "IMPLS", "plan", "timed_together", "record", "best_of",
           "format_table", "read_records", "write_records"]

SMALL = 4 << 10                                  #: bytes of the latency measure's one tensor
GROUPED = (1000, 4 << 10)                        #: tensors and bytes each of the grouped measure
SIZES = [(1 << 10) << (2 * i) for i in range(9)]  #: busbw sizes: 1 KiB .. 64 MiB, by 4x
MEASURES = ("latency", "grouped", "busbw")

#: Each implementation and what it is, as the table's legend prints it.
IMPLS = {
    "ours": "tfops (TF 2.21 eager tensors, named; `import tfops as hvd`)",
    "ours-np": "allreduce on numpy: allreduce_async(name=).wait() / grouped_allreduce / allreduce_ in place",
    "gloo": "torch.distributed, Gloo backend (torch CPU tensors, in place; average = sum then divide)",
    "horovod": "horovod.tensorflow 0.28.1 (TF 2.12 eager tensors, named; its own venv and mpirun)",
}
OURS = ("ours", "ours-np")
PEERS = ("gloo", "horovod")


def plan(measure: str, nbytes: int, *, quick: bool = False) -> tuple[int, int, int]:
    """(iters, warmup, repeats) for one row: many calls where a call is cheap, few at 64 MiB
    (Gloo moves about 1 GB/s here: 64 MiB takes ~0.1 s a call)."""
    if measure == "latency":
        plan_ = (200, 20, 5)
    elif measure == "grouped":
        plan_ = (5, 2, 3)
    else:
        plan_ = (max(3, min(100, (8 << 20) // max(nbytes, 1))), 2, 3)
    if quick:
        return max(1, plan_[0] // 20), 1, 1
    return plan_


def timed_together(fns: dict[str, Callable[[], object]], *, iters: int, warmup: int, repeats: int,
                   barrier: Callable[[], None], slowest: Callable[[float], float]) -> dict[str, float]:
    """Seconds per call of each variant: the slowest rank's mean over ``iters`` calls of its fastest
    of ``repeats`` blocks, the variants round-robin. ``barrier`` and ``slowest`` (max over ranks)
    are the launch's own collectives, so this runs under mpi4py and under Horovod alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / iters)
    return {name: slowest(t) for name, t in best.items()}


def record(measure: str, impl: str, nbytes: int, tensors: int, seconds: float, p: int) -> dict:
    """One row: ``nbytes`` in all (the grouped measure: all tensors together)."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return {"measure": measure, "impl": impl, "size_bytes": nbytes, "tensors": tensors, "ranks": p,
            "time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (p - 1) / p}


def best_of(launches: list[list[dict]]) -> list[dict]:
    """One row per (measure, impl, size): the fastest over launches, in first-seen order."""
    best: dict[tuple, dict] = {}
    for rows in launches:
        for r in rows:
            key = (r["measure"], r["impl"], r["size_bytes"])
            if key not in best or r["time_us"] < best[key]["time_us"]:
                best[key] = r
    return list(best.values())


_COLS = (("measure", 8), ("size(B)", 10), ("tensors", 7), ("impl", 8), ("time(us)", 11), ("algbw", 8),
         ("busbw", 8), ("t/ours", 7))


def format_table(records: list[dict]) -> list[str]:
    """nccl-tests style: one line per (measure, size, impl), ours first, then the peers; the last
    column is this row's time over ours' (tfops) time: above 1.00 ours is faster."""
    order = {name: i for i, name in enumerate(IMPLS)}
    rows = sorted(records, key=lambda r: (MEASURES.index(r["measure"]), r["size_bytes"], order.get(r["impl"], 9)))
    ours = {(r["measure"], r["size_bytes"]): r["time_us"] for r in rows if r["impl"] == "ours"}
    lines = ["#" + " ".join(f"{n:>{w}}" for n, w in _COLS)]
    for r in rows:
        base = ours.get((r["measure"], r["size_bytes"]))
        ratio = f"{r['time_us'] / base:.2f}x" if base and r["impl"] != "ours" else "-"
        cells = (r["measure"], r["size_bytes"], r["tensors"], r["impl"], f"{r['time_us']:.1f}",
                 f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", ratio)
        lines.append(" " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLS)))
    return lines


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["records"]


def write_records(path: str, records: list[dict], **extra) -> None:
    with open(path, "w") as f:
        json.dump({**extra, "records": records}, f, indent=1)
        f.write("\n")
