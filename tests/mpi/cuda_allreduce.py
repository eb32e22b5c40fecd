"""Rank script: allreduce of GPU arrays under mpirun: correctness matrix, then a busbw sweep.

Needs a CUDA GPU. Used by ``tests/test_cuda_gpu.py`` and ``scripts/gpu_check.sh``::

    mpirun -np 2 python tests/mpi/cuda_allreduce.py --path staging --check --bench

``--path ipc`` turns on ``cuda_ipc`` (reduce straight from peers' buffers); if
the library falls back to staging, the script says so and exits 3. Every rank
checks its result against the float64 reference of all ranks' inputs and
that all ranks hold bitwise identical bytes. Rank 0 prints one ``RESULT``
line per part, which gpu_check.sh collects into its table.
"""
import argparse
import sys
import time
import warnings

import numpy as np
from mpi4py import MPI

import allreduce as ar
from allreduce import device
from allreduce.kernels import cuda as dk
from allreduce.kernels.reference import allreduce_reference, tolerance
from allreduce.ops import SUPPORTED_DTYPES, Op

parser = argparse.ArgumentParser()
parser.add_argument("--path", choices=["staging", "ipc"], default="staging")
parser.add_argument("--check", action="store_true")
parser.add_argument("--bench", action="store_true")
parser.add_argument("--max-bytes", type=int, default=64 << 20)
parser.add_argument("--array", choices=["auto", "cupy", "numba"], default="auto")
args = parser.parse_args()

world = MPI.COMM_WORLD
comm = ar.init(cuda_ipc=args.path == "ipc", engine=False)
p, me = comm.size, comm.rank
dev = device.select_device(comm.local_rank, override=comm.config.device)
cp = dk._cupy() if args.array in ("auto", "cupy") else None
if args.array == "cupy" and cp is None:
    sys.exit("--array cupy: CuPy is not usable here")
kind = "cupy" if cp is not None else "numba"
fell_back: list[str] = []


def to_device(x: np.ndarray):
    raw = x.view(np.uint16) if x.dtype == ar.bfloat16 else x
    arr = cp.asarray(raw) if cp is not None else dk.cuda.to_device(raw)
    return device.Typed(arr, ar.bfloat16) if x.dtype == ar.bfloat16 else arr


def to_host(y, dtype) -> np.ndarray:
    raw = y.array if isinstance(y, device.Typed) else y
    host = cp.asnumpy(raw) if cp is not None else raw.copy_to_host()
    return host.view(dtype)


def reduce(x, op, algorithm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = comm.allreduce(x, op, algorithm=algorithm)
    fell_back.extend(str(w.message) for w in caught if "CUDA IPC" in str(w.message))
    return out


def check() -> int:
    rng = np.random.default_rng(99)               # the same stream on every rank
    failures = cases = 0
    for dtype in SUPPORTED_DTYPES:
        for op in Op:
            for count in (0, 1, 1001, 65537):
                ints = dtype.kind in "iu"
                lo, hi = (0, 3) if op == Op.PRODUCT else (0, 50)
                inputs = [(rng.integers(lo, hi, count) if ints or op != Op.PRODUCT
                           else rng.uniform(0.5, 1.5, count)).astype(dtype) for _ in range(p)]
                want = allreduce_reference(inputs, op)
                for algorithm in ("ring", "rhd"):
                    cases += 1
                    got = to_host(reduce(to_device(inputs[me]), op, algorithm), dtype)
                    tol = tolerance(dtype, p, op)
                    g, w = got.astype(np.float64), want.astype(np.float64)
                    scale = np.abs(w) if op == Op.PRODUCT else \
                        np.abs(np.stack([x.astype(np.float64) for x in inputs])).sum(0)
                    ok = np.array_equal(g, w, equal_nan=True) if tol == 0 else \
                        bool(np.all(np.abs(g - w) <= tol * (scale + np.abs(w)) + 1e-300))
                    blobs = world.allgather(got.tobytes())
                    ok = ok and all(b == blobs[0] for b in blobs)
                    if not ok:
                        failures += 1
                        if me == 0:
                            print(f"FAIL {dtype} {op!r} count={count} {algorithm}: got {got[:4]} want {want[:4]}")
    failures = world.allreduce(failures, MPI.MAX)
    if me == 0:
        print(f"RESULT check path={args.path} np={p} array={kind} cases={cases} failures={failures}", flush=True)
    return failures


def bench() -> None:
    if me == 0:
        print(f"# allreduce busbw, {kind} float32 arrays, path={args.path}, np={p}, ranks share the GPUs, local_rank % GPUs "
              f"(rank 0: device {dev}); command: mpirun -np {p} python {' '.join(sys.argv)}")
        print(f"#{'size (B)':>12} {'count':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    size, best = 4096, (0.0, 0)
    while size <= args.max_bytes:
        x = to_device(np.ones(size // 4, np.float32))
        reduce(x, Op.SUM, "ring")                  # warm up: compile, pin, map IPC handles
        iters = max(3, min(50, (256 << 20) // size))
        world.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            reduce(x, Op.SUM, "ring")
        elapsed = world.allreduce((time.perf_counter() - start) / iters, MPI.MAX)
        algbw = size / elapsed / 1e9
        busbw = algbw * 2 * (p - 1) / p            # nccl-tests' bus bandwidth for allreduce
        best = max(best, (busbw, size))
        if me == 0:
            print(f" {size:>12} {size // 4:>12} {elapsed * 1e6:>12.1f} {algbw:>13.3f} {busbw:>13.3f}", flush=True)
        size *= 4
    if me == 0:
        print(f"RESULT bench path={args.path} np={p} array={kind} peak_busbw={best[0]:.3f} at_bytes={best[1]}")


failures = check() if args.check else 0
if args.bench:
    bench()
if me == 0 and fell_back:
    print(f"RESULT fallback path={args.path} np={p}: {fell_back[0]}")
ar.shutdown()
sys.exit(1 if failures else 3 if (fell_back and args.path == "ipc") else 0)
