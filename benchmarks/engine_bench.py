"""What the engine's features buy, measured against the plain blocking path in the same run.

::

    mpirun -np 2 python benchmarks/engine_bench.py [--modes fusion,compression,resnet50,latency] [--json out.json]

=============  ==================================================================
mode           compares
=============  ==================================================================
fusion         1000 tensors of 4 KiB: ``allreduce_async`` on all, then wait (the
               engine fuses them into few allreduces) vs 1000 blocking
               ``allreduce_`` calls; and ``grouped_allreduce`` (one engine tensor);
               and the same in C: 1000 ``MPI_Allreduce`` calls vs one on the
               joined bytes, the most any fusion can gain on this machine; and
               the floor under any engine in Python: packing the tensors (pack)
               and a bare handle per tensor (handles)
compression    one bandwidth-bound float32 tensor: Compression.none / fp16 /
               bf16 through the engine; time and max relative error
resnet50       one training step's 161 gradients (25.6M float32, resnet50_shapes)
               through the engine (new result arrays, and in place with
               ``allreduce_async_``) vs one raw allreduce of the same bytes
latency        one 4-byte tensor: ``allreduce_async(...).wait()`` round trip
               vs one blocking ``allreduce_``
=============  ==================================================================

Timing as in allreduce_bench.py: warm up, barrier, ``-n`` repetitions, the
slowest rank's mean. The direct path runs with ``check=False``.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.resnet50_shapes import SHAPES  # noqa: E402

MODES = ("fusion", "compression", "resnet50", "latency")
_COLS = (("mode", 11), ("variant", 18), ("size(B)", 11), ("tensors", 7), ("time(us)", 11), ("algbw", 7),
         ("busbw", 7), ("relerr", 9))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="engine benchmarks (run under mpirun)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("-n", "--iters", type=int, default=5)
    parser.add_argument("-w", "--warmup_iters", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="time -n calls this many times; keep the fastest")
    parser.add_argument("--tensors", type=int, default=1000, help="fusion: number of tensors")
    parser.add_argument("--tensor-bytes", type=common.parse_size, default=4096, help="fusion: bytes per tensor")
    parser.add_argument("--compress-sizes", default="4M,32M", help="compression: comma list of sizes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.mode_list = [m for m in args.modes.split(",") if m]
    unknown = set(args.mode_list) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    args.compress_list = [common.parse_size(s) for s in args.compress_sizes.split(",") if s]
    return args


def timed_together(fns: dict, args, mpi) -> dict:
    """Each variant's seconds per call: the slowest rank's mean over -n calls after warmup, each
    rank's fastest of --repeats blocks. Round-robin: repeat r runs a block of every variant before
    repeat r + 1 starts, so a ratio of two variants compares blocks run seconds apart, not minutes
    (the VM's speed drifts by 2x over a run)."""
    for fn in fns.values():
        for _ in range(args.warmup_iters):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(args.repeats):
        for name, fn in fns.items():
            mpi.Barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / args.iters)
    return {name: mpi.allreduce(t, op=_mpi_max()) for name, t in best.items()}


def _record(mode: str, variant: str, nbytes: int, tensors: int, seconds: float, p: int,
            relerr: float | None = None) -> dict:
    algbw, busbw = common.bandwidths(nbytes, seconds, "allreduce", p)
    return {"mode": mode, "collective": "allreduce", "size_bytes": nbytes, "count": nbytes // 4,
            "dtype": "float32", "op": "avg", "algorithm": variant, "ranks": p, "tensors": tensors,
            "time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw, "wrong": None,
            "max_rel_err": relerr}


def _wait_all(handles) -> None:
    for h in handles:
        h.wait()


def bench_fusion(ar, args, mpi) -> list[dict]:
    p, count = mpi.Get_size(), max(args.tensor_bytes // 4, 1)
    grads = [np.ones(count, np.float32) for _ in range(args.tensors)]
    names = [f"fusion.{i}" for i in range(args.tensors)]
    comm, total = ar.communicator(), args.tensors * count * 4

    def engine():
        _wait_all([ar.allreduce_async(g, name=n, op=ar.Average) for g, n in zip(grads, names)])

    def unfused():
        for g in grads:
            comm.allreduce_(g, ar.Average)

    variants = {"engine": engine, "unfused-blocking": unfused}
    if hasattr(ar, "grouped_allreduce"):
        variants["grouped"] = lambda: ar.grouped_allreduce(grads, name="grouped", op=ar.Average)
    # The most fusion can gain on this machine: MPI_Allreduce in C, 1000 small calls against one
    # call on the same bytes, with no Python, packing or negotiation at all.
    from mpi4py import MPI
    outs = [np.empty_like(g) for g in grads]
    joined, joined_out = np.concatenate(grads), np.empty(sum(g.size for g in grads), np.float32)

    def native_unfused():
        for g, o in zip(grads, outs):
            mpi.Allreduce(g, o, op=MPI.SUM)

    variants["native-unfused"] = native_unfused
    variants["native-fused"] = lambda: mpi.Allreduce(joined, joined_out, op=MPI.SUM)
    # The floor under the engine, in the same run: what any fusing engine in Python pays whatever its
    # design. "pack": copying the tensors into one buffer (one C call). "handles": one handle object
    # per tensor made, completed and waited on, nothing else (the engine's own Handle).
    from allreduce.engine.handle import Handle
    variants["pack"] = lambda: np.concatenate(grads, out=joined)
    variants["handles"] = functools.partial(_bare_handles, Handle, names, grads)
    times = timed_together(variants, args, mpi)
    return [_record("fusion", v, total, 1 if v in ("native-fused", "pack") else args.tensors, t, p)
            for v, t in times.items()]


def _bare_handles(handle_class, names, results) -> None:
    """Handles made, completed as the engine completes a batch (each one's result and flag set,
    then one announcement), and waited on."""
    from allreduce.engine.handle import announce
    handles = [handle_class(n) for n in names]
    for h, x in zip(handles, results):
        h._result, h._done = x, True
    announce()
    for h in handles:
        h.wait()


def _rel_err(got: np.ndarray, exact: np.ndarray) -> float:
    """max |got - exact| / max |exact|: the error relative to the tensor's scale (near-zero entries allowed)."""
    return float(np.max(np.abs(got.astype(np.float64) - exact)) / max(np.max(np.abs(exact)), 1e-300))


def bench_compression(ar, args, mpi) -> list[dict]:
    p, rank, out = mpi.Get_size(), mpi.Get_rank(), []
    for nbytes in args.compress_list:
        count = nbytes // 4
        inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(p)]
        exact = np.mean([x.astype(np.float64) for x in inputs], axis=0)
        mine = inputs[rank]
        errors, variants = {}, {}
        for label in ("none", "fp16", "bf16"):
            compression = getattr(ar.Compression, label)
            result = ar.allreduce_async(mine, name=f"compress.{nbytes}", op=ar.Average,
                                        compression=compression).wait()
            errors[label] = mpi.allreduce(_rel_err(result, exact), op=_mpi_max())
            variants[label] = functools.partial(_one_async, ar, mine, f"compress.{nbytes}", compression)
        times = timed_together(variants, args, mpi)
        out += [_record("compression", v, nbytes, 1, t, p, errors[v]) for v, t in times.items()]
    return out


def _one_async(ar, x, name, compression):
    ar.allreduce_async(x, name=name, op=ar.Average, compression=compression).wait()


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


def bench_resnet50(ar, args, mpi) -> list[dict]:
    p = mpi.Get_size()
    grads = [np.ones(shape, np.float32) for _, shape in SHAPES]
    names = [name for name, _ in SHAPES]
    flat = np.ones(sum(g.size for g in grads), np.float32)
    comm, total = ar.communicator(), flat.nbytes

    def step():
        _wait_all([ar.allreduce_async(g, name=n, op=ar.Average) for g, n in zip(grads, names)])

    variants = {"engine-161": step}
    if hasattr(ar, "allreduce_async_"):      # in place: results land in the gradient buffers themselves
        def step_inplace():
            _wait_all([ar.allreduce_async_(g, name=n, op=ar.Average) for g, n in zip(grads, names)])
        variants["engine-161-inplace"] = step_inplace
    reducer = getattr(ar.api._running_engine(), "reducer", None)
    settled = _settle(list(variants.values()), reducer)
    kept = "; ".join(f"{k[0]} tensors, {k[1] / 2**20:.1f} MiB: {reducer.batch_picks[k]} ("
                     + ", ".join(f"{w} {t * 1e3:.1f} ms" for w, t in reducer.tuner.decided.get(k, {}).items()) + ")"
                     for k in sorted(reducer.batch_picks, key=lambda k: -k[1])[:2]) if reducer else ""
    variants["raw-allreduce"] = lambda: comm.allreduce_(flat, ar.Average)
    times = timed_together(variants, args, mpi)
    records = [_record("resnet50", v, total, 1 if v == "raw-allreduce" else len(grads), t, p) for v, t in times.items()]
    for r in records:
        r["settle_steps"], r["batch_picks"] = settled, kept
    return records


SETTLE_STEPS = 120   #: at most this many warm-up steps for the engine's batch tuner


def _settle(steps: list, reducer) -> int:
    """Run the engine ``steps`` round-robin until its batch tuner (``reducer``, the engine's
    :class:`allreduce.engine.reducer.Reducer`) has kept a way for every batch it has met twice; a
    training loop runs thousands of steps, and the table is about those. The tuner's state is the
    same on every rank after each step (its agreements are collective), so every rank stops at
    the same step. Returns the steps run."""
    count = 0
    while count < SETTLE_STEPS and (count < 2 or (reducer is not None and reducer.tuning)):
        for step in steps:
            step()
        count += 1
    return count


def bench_latency(ar, args, mpi) -> list[dict]:
    p, x, comm = mpi.Get_size(), np.ones(1, np.float32), ar.communicator()
    engine = lambda: ar.allreduce_async(x, name="latency", op=ar.Average).wait()  # noqa: E731
    direct = lambda: comm.allreduce_(x, ar.Average)  # noqa: E731
    reps = argparse.Namespace(iters=max(args.iters, 50), warmup_iters=max(args.warmup_iters, 5),
                              repeats=args.repeats)
    times = timed_together({"engine-roundtrip": engine, "blocking": direct}, reps, mpi)
    return [_record("latency", v, 4, 1, t, p) for v, t in times.items()]


def format_table(records: list[dict]) -> list[str]:
    lines = ["#" + " ".join(f"{n:>{w}}" for n, w in _COLS)]
    for r in records:
        err = "-" if r["max_rel_err"] is None else f"{r['max_rel_err']:.2e}"
        cells = (r["mode"], r["algorithm"], r["size_bytes"], r["tensors"], f"{r['time_us']:.1f}",
                 f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", err)
        lines.append(" " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLS)))
    return lines


def ratios(records: list[dict]) -> list[str]:
    """One '#' line per mode: how the engine compares with its baseline."""
    t = {(r["mode"], r["algorithm"]): r["time_us"] for r in records}
    out = []
    for mode, fast, base in (("fusion", "engine", "unfused-blocking"), ("fusion", "grouped", "unfused-blocking"),
                             ("fusion", "native-fused", "native-unfused"), ("fusion", "engine", "native-unfused"),
                             ("resnet50", "engine-161", "raw-allreduce"),
                             ("resnet50", "engine-161-inplace", "raw-allreduce"),
                             ("latency", "engine-roundtrip", "blocking")):
        if (mode, fast) in t and (mode, base) in t:
            out.append(f"# {mode}: {fast} / {base} time = {t[(mode, fast)] / t[(mode, base)]:.2f}x")
    bound = fusion_bound(records)
    if bound:
        out.append("# fusion: per tensor, raw MPI_Allreduce {raw:.2f} us; engine {engine:.2f} us, of which packing "
                   "and one fused allreduce {fixed:.2f} us, its Python {python:.2f} us; a bare handle {handle:.2f} us"
                   .format(**bound))
    return out


def fusion_bound(records: list[dict]) -> dict | None:
    """Per tensor (us), from one run's fusion rows: a raw 4 KiB MPI_Allreduce call, the engine, its
    fixed part (packing the tensors and one MPI_Allreduce on the joined bytes, spread over the tensors),
    its Python (the rest: submit, negotiation, views, finish, wait), and a bare handle; with
    ``budget``, what 1.0x against the raw calls leaves the Python per tensor, and ``floor``, the raw
    time / the time of the fixed part plus bare handles (the most any engine in Python reaches here)."""
    rows = {r["algorithm"]: r for r in records if r["mode"] == "fusion"}
    if not all(k in rows for k in ("engine", "native-unfused", "native-fused", "pack", "handles")):
        return None
    n = rows["engine"]["tensors"]
    per = {k: rows[k]["time_us"] / n for k in ("engine", "native-unfused", "native-fused", "pack", "handles")}
    fixed = per["pack"] + per["native-fused"]
    return {"raw": per["native-unfused"], "engine": per["engine"], "fixed": fixed,
            "python": per["engine"] - fixed, "handle": per["handles"], "budget": per["native-unfused"] - fixed,
            "floor": per["native-unfused"] / (fixed + per["handles"]), "tensors": n}


def main(argv=None) -> int:
    args = parse_args(argv)
    from allreduce.transport.mpi import MPI   # MPI starts with the library's Open MPI defaults
    import allreduce as ar
    missing = [f for f in ("allreduce_async", "Compression") if not hasattr(ar, f)]
    if missing:
        print(f"engine_bench: allreduce has no {', '.join(missing)} yet (the engine API is not in this tree)",
              file=sys.stderr)
        return 2
    mpi = MPI.COMM_WORLD
    ar.init(check=False)
    command = common.command_line()
    desc = common.machine_description()
    records = []
    for mode in args.mode_list:
        if mpi.Get_rank() == 0:
            print(f"[engine-bench] {mode}", file=sys.stderr, flush=True)
        records += globals()[f"bench_{mode}"](ar, args, mpi)
    if mpi.Get_rank() == 0:
        lines = [f"# engine benchmark: {mpi.Get_size()} ranks, float32, op avg", f"# command: {command}"]
        lines += common.machine_header(desc)
        lines += [f"# time = slowest rank's mean over -n {args.iters} after -w {args.warmup_iters} warmup"
                  f" (latency: -n 50 -w 5 at least), fastest of --repeats {args.repeats}, "
                  "round-robin over a mode's variants; "
                  "relerr = max|got - exact| / max|exact| (float64 exact mean)"]
        settle = next((r["settle_steps"] for r in records if "settle_steps" in r), None)
        if settle is not None:
            kept = next(r["batch_picks"] for r in records if "settle_steps" in r)
            lines.append(f"# resnet50: the engine's batch tuner (shm's many-call or rhd per array) ran {settle} "
                         f"warm-up steps before the timing; kept per direct batch: {kept or 'nothing (untuned)'}")
        print("\n".join(lines + format_table(records) + ratios(records)), flush=True)
        if args.json:
            common.write_json(args.json, {"command": command, "machine": desc, "ranks": mpi.Get_size(),
                                          "collective": "allreduce", "dtype": "float32", "op": "avg"}, records)
    ar.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
