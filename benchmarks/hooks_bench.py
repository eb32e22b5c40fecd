"""Bytes and exchange time per step of ResNet-50's gradients through each communication hook.

::

    allreduce-run -np 2 python benchmarks/hooks_bench.py                  # one node
    allreduce-cluster up --nodes 2 --link 1gbit --slots 1
    allreduce-run --cluster -np 2 python benchmarks/hooks_bench.py --json out.json

The gradient set is Keras' ResNet-50 (benchmarks/resnet50_shapes.keras_shapes: 214 tensors,
25,583,592 float32), random per rank. One step = every gradient submitted as ONE grouped call
(one bucket: the hook sees the whole set, so all P's travel in one allreduce and all Q's in
another), then waited for. Methods::

    fp32        the plain allreduce                 fp16       Compression.fp16
    powersgdR   ar.PowerSGD(rank=R, start_iter=0)   onebit     ar.OneBit()

Per method, ``--warmup`` steps, then ``--steps`` timed ones; each column is the median step:

* payload   bytes this rank handed to collectives per step: the hook runs unchanged inside
            :class:`Counting`, whose communicator counts every buffer the hook gives its
            allreduces, alltoallv and allgatherv (bytes kept on this rank not counted);
            fp32/fp16: every element in the compressor's wire dtype, one allreduce;
* host tx   bytes this host's network interface sent per step: ``/proc/net/dev`` of the rank's
            network namespace (the cluster's ``eth0``), read by each host's first rank between
            barriers: the transport's own count, TCP/IP headers included. '-' on one node, where
            the ranks talk through shared memory;
* exchange  first submit -> last result, the slowest rank's; ``hook`` of it is the hook's own
            compute (its time in ``reduce`` less its time in collectives: the busiest rank's),
            the rest (``wire``) the collectives and the engine's negotiation.

Cost model (alpha-beta, one bucket of n float32 over p ranks, H hosts): fp32 sends 2n(H-1)/H x 4 B
from each host; fp16 half that; PowerSGD rank r sends, per compressed (rows x cols) matrix,
(rows + cols) r floats instead of rows x cols, in two allreduces (2 alphas), plus
the uncompressed vectors; 1-bit about n/8 bytes twice (the chunks' signs to their owners,
the owners' signs back) plus a scale per chunk.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import allreduce as ar  # noqa: E402
from benchmarks.resnet50_shapes import keras_shapes  # noqa: E402
from benchmarks.common import command_line  # noqa: E402

METHODS = ("fp32", "fp16", "powersgd1", "powersgd2", "powersgd4", "onebit")
#: ``--model small``: examples/keras_digits.py's MLP (64-64-10, 4,810 values): where a hook cannot pay.
SMALL = [("dense.kernel", (64, 64)), ("dense.bias", (64,)), ("dense_1.kernel", (64, 10)), ("dense_1.bias", (10,))]


class _CountingComm:
    """The engine's HookComm, counting the bytes a hook hands to each collective and the time
    spent inside them (every other attribute is the HookComm's own)."""

    def __init__(self, comm, counter: "Counting"):
        self._comm, self._counter = comm, counter

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _timed(self, fn, nbytes: int, *args):
        start = time.perf_counter()
        out = fn(*args)
        self._counter.comm_s += time.perf_counter() - start
        self._counter.handed += nbytes
        return out

    def allreduce(self, buf, op):
        return self._timed(self._comm.allreduce, buf.nbytes, buf, op)

    def allgatherv(self, block, out, counts):
        return self._timed(self._comm.allgatherv, block.nbytes, block, out, counts)

    def alltoallv(self, send, send_counts, recv, recv_counts):
        mine = send_counts[self._comm.rank] * send.itemsize          # what stays on this rank is not sent
        return self._timed(self._comm.alltoallv, send.nbytes - mine, send, send_counts, recv, recv_counts)


class Counting(ar.CommHook):
    """``inner`` as it is, run through a :class:`_CountingComm`: ``handed`` (bytes given to
    collectives), ``comm_s`` (time inside them) and ``hook_s`` (time inside ``inner.reduce``)."""

    def __init__(self, inner: ar.CommHook):
        self.inner, self.name = inner, inner.name
        self.handed, self.comm_s, self.hook_s = 0, 0.0, 0.0

    def check(self, dtype, op, rank):
        self.inner.check(dtype, op, rank)

    def reduce(self, bucket, comm, state):
        start = time.perf_counter()
        out = self.inner.reduce(bucket, _CountingComm(comm, self), state)
        self.hook_s += time.perf_counter() - start
        return out


def make(method: str) -> tuple[dict, Counting | None]:
    """The grouped call's keyword arguments for ``method``, and its counting hook (None for fp32/fp16)."""
    if method == "fp32":
        return {}, None
    if method == "fp16":
        return {"compression": ar.Compression.fp16}, None
    if method.startswith("powersgd"):
        hook = Counting(ar.PowerSGD(rank=int(method[len("powersgd"):]), start_iter=0))
    elif method == "onebit":
        hook = Counting(ar.OneBit())
    else:
        raise SystemExit(f"hooks_bench: unknown method {method!r}; choose from {', '.join(METHODS)}")
    return {"comm_hook": hook}, hook


def tx_bytes(device: str = "eth0") -> int | None:
    """Bytes ``device`` has sent, from /proc/net/dev of this process's network namespace."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == device:
                    return int(rest.split()[8])
    except OSError:
        pass
    return None


def step_counts(hook: Counting | None, kw: dict, grads: list[np.ndarray]) -> dict:
    """One step's bytes handed to collectives by this rank, and the hook's compute (its time
    inside reduce less the time inside collectives)."""
    if hook is None:                      # a compressor: one allreduce of every element in its wire dtype
        wire = kw.get("compression", ar.Compression.none).wire_dtype(np.dtype(np.float32))
        return {"payload": sum(g.size for g in grads) * wire.itemsize, "hook_s": 0.0}
    return {"payload": hook.handed, "hook_s": hook.hook_s - hook.comm_s}


def run_method(method: str, grads: list[np.ndarray], args) -> dict:
    """Time ``method``'s steps; return this rank's medians and counts."""
    kw, hook = make(method)
    host_first = ar.local_rank() == 0 and ar.communicator().nodes > 1    # one node: shared memory, no link
    for _ in range(args.warmup):
        ar.grouped_allreduce_async(grads, name=f"hb.{method}", **kw).wait()
    times, payload, hook_s, tx = [], [], [], []
    for _ in range(args.steps):
        if hook is not None:
            hook.handed, hook.comm_s, hook.hook_s = 0, 0.0, 0.0
        ar.barrier()
        before = tx_bytes() if host_first else None
        start = time.perf_counter()
        ar.grouped_allreduce_async(grads, name=f"hb.{method}", **kw).wait()
        times.append(time.perf_counter() - start)
        ar.barrier()
        after = tx_bytes() if host_first else None
        counts = step_counts(hook, kw, grads)
        payload.append(counts["payload"])
        hook_s.append(counts["hook_s"])
        if before is not None and after is not None:
            tx.append(after - before)
    return {"method": method, "exchange_s": statistics.median(times), "hook_s": statistics.median(hook_s),
            "payload": statistics.median(payload), "host_tx": statistics.median(tx) if tx else None}


def gather(row: dict) -> dict:
    """Rank 0's view: the slowest rank's exchange, the busiest rank's hook, every host's tx."""
    rows = ar.allgather_object(row)
    txs = [r["host_tx"] for r in rows if r["host_tx"] is not None]
    return {"method": row["method"], "exchange_ms": 1e3 * max(r["exchange_s"] for r in rows),
            "hook_ms": 1e3 * max(r["hook_s"] for r in rows), "payload": max(r["payload"] for r in rows),
            "host_tx": max(txs) if txs else None}


def table(rows: list[dict], header: list[str]) -> list[str]:
    """The printed table: one line per method, ratios against fp32 (bytes) and fp16 (time)."""
    fp32 = next((r for r in rows if r["method"] == "fp32"), None)
    fp16 = next((r for r in rows if r["method"] == "fp16"), None)
    out = header + [f"{'method':<10} {'payload(B)':>12} {'vs fp32':>8} {'host tx(B)':>12} {'vs fp32':>8} "
                    f"{'exchange(ms)':>12} {'hook(ms)':>9} {'wire(ms)':>9} {'fp16/this':>9}"]
    for r in rows:
        tx = f"{int(r['host_tx']):>12,}" if r["host_tx"] is not None else f"{'-':>12}"
        tx_ratio = (f"{fp32['host_tx'] / r['host_tx']:>7.1f}x" if fp32 and fp32["host_tx"] and r["host_tx"]
                    else f"{'-':>8}")
        speed = f"{fp16['exchange_ms'] / r['exchange_ms']:>8.2f}x" if fp16 else f"{'-':>9}"
        out.append(f"{r['method']:<10} {int(r['payload']):>12,} "
                   f"{(fp32['payload'] / r['payload']) if fp32 else 0:>7.1f}x {tx} {tx_ratio} "
                   f"{r['exchange_ms']:>12.2f} {r['hook_ms']:>9.2f} {r['exchange_ms'] - r['hook_ms']:>9.2f} {speed}")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method (the median is shown)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", choices=("resnet50", "small"), default="resnet50")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every tensor's last dimension (tests)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    ar.init()
    model = keras_shapes() if args.model == "resnet50" else SMALL
    shapes = [s[:-1] + (max(1, round(s[-1] * args.scale)),) for _, s in model]
    rng = np.random.default_rng(ar.rank())
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    comm = ar.communicator()
    hosts, n = comm.nodes, sum(math.prod(s) for s in shapes)
    header = [f"# {command_line()}",
              f"# {'ResNet-50 (Keras)' if args.model == 'resnet50' else 'the digits MLP'}: {len(shapes)} tensors, {n:,} float32, one grouped call per step; {ar.size()} "
              f"ranks on {hosts} host(s); medians of {args.steps} steps after {args.warmup} warm-up; "
              "exchange: the slowest rank's; host tx: the busiest host's interface"]
    rows = []
    for method in args.methods.split(","):
        rows.append(gather(run_method(method, grads, args)))
        if ar.rank() == 0:
            print(f"[hooks_bench] {method} done", file=sys.stderr, flush=True)
    if ar.rank() == 0:
        print("\n".join(table(rows, header)), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "ranks": ar.size(), "hosts": hosts, "tensors": len(shapes), "elements": n,
                           "steps": args.steps, "rows": rows}, f, indent=1)
    ar.shutdown()


if __name__ == "__main__":
    main()
