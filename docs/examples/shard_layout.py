"""Lesson 14: where each parameter's optimizer state lives when it is sharded (tfops.ShardedOptimizer).

    python docs/examples/shard_layout.py --sizes 6,2,9,1 -p 4          # the layout, computed
    allreduce-run -np 4 python docs/examples/shard_layout.py --sizes 6,2,9,1 --run   # and measured

Lays variables of the given element counts end to end, cuts them into buckets in backprop
order and each bucket into p pieces, and prints the buckets, each rank's segments of variables
and the bytes of Adam state (m and v, float32) it holds against one unsharded Adam. With ``--run`` (under allreduce-run) each
rank builds ``tfops.ShardedOptimizer(Adam)`` over real variables of those sizes and prints the
bytes of its slot variables, measured: they must equal the computed ones.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

from tfops.sharding.layout import shards  # noqa: E402


class _Var:
    def __init__(self, n: int):
        self.shape, self.dtype = (n,), "float32"


def show(sizes: list[int], p: int, bucket_bytes: int | None) -> None:
    variables = [_Var(n) for n in sizes]
    first = shards(variables, 0, p, bucket_bytes)[0]
    print(f"{first.total} parameters; unsharded Adam state {8 * first.total} bytes")
    for k, b in enumerate(first.buckets):
        names = " ".join(f"v{v}" for v in b.vars)
        print(f"bucket {k} ({names}): flat [{b.start}, {b.stop}), pieces {' '.join(map(str, b.counts))}")
    for r in range(p):
        sh = shards(variables, r, p, bucket_bytes)[0]
        pieces = " ".join(f"v{s.var}[{s.var_start}:{s.var_start + s.size}]" for s in sh.segments)
        state = 8 * sum(s.size for s in sh.segments)
        print(f"rank {r}: {sh.per_rank} elements  {pieces:<28} Adam state {state} bytes")


def run(sizes: list[int]) -> None:
    import keras
    import tfops
    tfops.init()
    variables = [keras.Variable(np.zeros(n, "float32"), name=f"v{i}") for i, n in enumerate(sizes)]
    opt = tfops.ShardedOptimizer(keras.optimizers.Adam())
    opt.build(variables)
    slots = opt.inner_optimizer.variables[2:]               # m and v of each segment; 0, 1: iteration, lr
    print(f"rank {tfops.rank()} of {tfops.size()}: Adam state {sum(v.numpy().nbytes for v in slots)} bytes, measured")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="6,2,9,1", help="element counts of the variables, in model order")
    parser.add_argument("-p", type=int, default=4, help="ranks (without --run)")
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="bytes per bucket (default tfops.training.overlap's); small values show several buckets")
    parser.add_argument("--run", action="store_true", help="measure a real ShardedOptimizer (under allreduce-run)")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    run(sizes) if args.run else show(sizes, args.p, args.bucket_bytes)


if __name__ == "__main__":
    main()
