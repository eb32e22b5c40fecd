"""Our side of the peer comparison (tfops and numpy), or Gloo's, in one launch.

::

    mpirun -np 2 python benchmarks/peers/ours_bench.py --impl ours --json ours.json
    mpirun -np 2 python benchmarks/peers/ours_bench.py --impl gloo --json gloo.json

``--impl ours`` times two rows per measure (benchmarks/peers/timing.py): ``ours``
(tfops on TF tensors, the API horovod.tensorflow has) and ``ours-np`` (the same engine on
numpy arrays). ``--impl gloo`` times torch.distributed's Gloo backend in a process
without TensorFlow. Each launch prints its table; ``--json`` keeps its rows. Every call
averages over the ranks; results are checked once (all ones in, all ones out).
"""
from __future__ import annotations

import argparse
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from benchmarks.peers import timing  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ours or Gloo, for the peer comparison (run under mpirun)")
    parser.add_argument("--impl", choices=("ours", "gloo"), required=True)
    parser.add_argument("--measures", default=",".join(timing.MEASURES))
    parser.add_argument("--max-bytes", type=int, default=timing.SIZES[-1], help="largest busbw size")
    parser.add_argument("--quick", action="store_true", help="a few calls per row: checks the plumbing")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.measure_list = [m for m in args.measures.split(",") if m]
    unknown = set(args.measure_list) - set(timing.MEASURES)
    if unknown:
        parser.error(f"unknown measure(s) {', '.join(sorted(unknown))}; choose from {', '.join(timing.MEASURES)}")
    return args


def ours_variants(measure: str, nbytes: int, tensors: int) -> dict:
    """{impl: one call} for our two rows; each call's result is checked once before timing."""
    import tensorflow as tf
    import allreduce as ar
    import tfops
    count = nbytes // tensors // 4
    arrays = [np.ones(count, np.float32) for _ in range(tensors)]
    tf_tensors = [tf.constant(a) for a in arrays]
    name = f"peers.{measure}.{nbytes}"
    if measure == "grouped":
        fns = {"ours": lambda: tfops.grouped_allreduce(tf_tensors, name=name),
               "ours-np": lambda: ar.grouped_allreduce(arrays, name=name + ".np", op=ar.Average)}
    elif measure == "latency":
        fns = {"ours": lambda: [tfops.allreduce(tf_tensors[0], name=name)],
               "ours-np": lambda: [ar.allreduce_async(arrays[0], name=name + ".np", op=ar.Average).wait()]}
    else:                                          # busbw: numpy in place, as nccl-tests and Gloo run
        comm = ar.communicator()
        fns = {"ours": lambda: [tfops.allreduce(tf_tensors[0], name=name)],
               "ours-np": lambda: [comm.allreduce_(arrays[0], ar.Average)]}
    for impl, fn in fns.items():
        _check(impl, [np.asarray(y) for y in fn()])
    return fns


def gloo_variants(measure: str, nbytes: int, tensors: int, p: int) -> dict:
    """{"gloo": one call}: all_reduce (sum) then divide by p, as DDP's default hook averages."""
    import torch
    import torch.distributed as dist
    ts = [torch.ones(nbytes // tensors // 4, dtype=torch.float32) for _ in range(tensors)]
    if measure == "grouped":                       # no grouped call in torch.distributed: async, then wait
        def call():
            for work in [dist.all_reduce(t, async_op=True) for t in ts]:
                work.wait()
            torch._foreach_div_(ts, float(p))
            return ts
    else:
        def call():
            dist.all_reduce(ts[0])
            ts[0].div_(p)
            return ts[:1]
    _check("gloo", [t.numpy() for t in call()])
    return {"gloo": call}


def _check(impl: str, results: list) -> None:
    """Ones averaged over the ranks are ones: a peer that does not reduce fails here, not in a table."""
    for y in results:
        if y.size and not np.array_equal(y, np.ones_like(y)):
            raise SystemExit(f"ours_bench: {impl} returned a wrong average (first {y.ravel()[:4]})")


def _gloo_init(mpi) -> None:
    from benchmarks.peers.runners import _gloo_init as init
    init(types.SimpleNamespace(mpi_comm=mpi, size=mpi.Get_size()))


def rows_for(args, mpi) -> list[dict]:
    from mpi4py import MPI
    p = mpi.Get_size()
    sync = {"barrier": mpi.Barrier, "slowest": lambda t: mpi.allreduce(t, op=MPI.MAX)}
    points = {"latency": [(timing.SMALL, 1)], "grouped": [(timing.GROUPED[0] * timing.GROUPED[1], timing.GROUPED[0])],
              "busbw": [(s, 1) for s in timing.SIZES if s <= args.max_bytes]}
    records = []
    for measure in args.measure_list:
        for nbytes, tensors in points[measure]:
            if args.impl == "ours":
                fns = ours_variants(measure, nbytes, tensors)
            else:
                fns = gloo_variants(measure, nbytes, tensors, p)
            iters, warmup, repeats = timing.plan(measure, nbytes, quick=args.quick)
            times = timing.timed_together(fns, iters=iters, warmup=warmup, repeats=repeats, **sync)
            records += [timing.record(measure, impl, nbytes, tensors, t, p) for impl, t in times.items()]
            if mpi.Get_rank() == 0:
                print(f"[peers] {args.impl} {measure} {nbytes} B done", file=sys.stderr, flush=True)
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.impl == "ours":
        from allreduce.transport.mpi import MPI   # MPI starts with the library's Open MPI defaults
        import tensorflow as tf
        import tfops
        tf.config.threading.set_intra_op_parallelism_threads(1)      # as horovod_bench.py: 2 ranks, 2 cores
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tfops.init()
        mpi = MPI.COMM_WORLD
    else:
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            print(f"# skipped gloo: torch is not importable ({exc}); pip install -e '.[bench]'", flush=True)
            return 0
        from mpi4py import MPI
        mpi = MPI.COMM_WORLD
        _gloo_init(mpi)
    records = rows_for(args, mpi)
    if mpi.Get_rank() == 0:
        print("\n".join(timing.format_table(records)), flush=True)
        if args.json:
            timing.write_records(args.json, records, impl=args.impl)
    if args.impl == "ours":
        import allreduce as ar
        ar.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
