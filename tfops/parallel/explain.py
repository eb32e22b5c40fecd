"""``allreduce-explain megatron-mlp --tensor 2``: one MLP block of tensor parallelism, run for real,
with each rank's shapes and every collective it ran, forward and backward.

::

    allreduce-explain megatron-mlp --tensor 2
    allreduce-explain megatron-mlp --tensor 4 --hidden 8 --sequence-parallel
    mpirun -np 2 python -m tfops.parallel.explain --tensor 2        # the same, launched by hand

How: ``allreduce/explain/__main__.py`` hands ``megatron-mlp`` to :func:`main` here, importing tfops
only then (allreduce/ sits below tfops and never imports it at module level). Started as one process,
:func:`main` starts ``mpirun -np TENSOR`` of this module; each rank builds a
``ColumnParallelDense(4h, gelu) -> RowParallelDense(h)`` pair on ``Mesh(tensor=TENSOR)``, runs one
forward and one backward under :func:`tfops.parallel.regions.record`, and rank 0 prints what every rank
recorded: the printed collectives are the ones the region operators ran, not a description of them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="allreduce-explain megatron-mlp",
                                description="One Megatron MLP block (column- then row-parallel), run on TENSOR "
                                            "ranks: each rank's shapes and every collective, forward and backward.")
    p.add_argument("--tensor", type=int, required=True, help="tensor-parallel ranks (processes started)")
    p.add_argument("--hidden", type=int, default=8, help="hidden size h (the MLP is h -> 4h -> h)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="activations split along the sequence between blocks (allgather / reduce-scatter)")
    return p


def _launch(argv: list[str], tensor: int) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("allreduce-explain megatron-mlp: mpirun not found (pip install -e .[test])", file=sys.stderr)
        return 1
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(tensor), sys.executable, "-m",
           "tfops.parallel.explain", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    sys.stdout.write(done.stdout)            # through Python's stdout, so a caller that captures it gets it
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
    return done.returncode


def _run(args) -> list[str]:
    """This rank's lines: weights, then each collective the block ran, forward and backward."""
    import numpy as np
    import tensorflow as tf

    from . import ColumnParallelDense, Mesh, RowParallelDense, regions
    mesh = Mesh(tensor=args.tensor)
    h, t, k = args.hidden, mesh.tensor, mesh.tensor_rank
    sp = args.sequence_parallel
    up = ColumnParallelDense(4 * h, mesh, activation="gelu", sequence_parallel=sp)
    down = RowParallelDense(h, mesh, sequence_parallel=sp)
    seq = args.seq // t if sp else args.seq
    x = tf.constant(np.random.default_rng(0).standard_normal((args.batch, seq, h)), tf.float32)
    log: list = []
    with tf.GradientTape() as tape:
        tape.watch(x)
        regions.record(log)
        middle = up(x)
        y = down(middle)
        log.append(("", "backward", ()))
        loss = tf.reduce_sum(y)
    tape.gradient(loss, [x] + up.trainable_weights + down.trainable_weights)
    regions.record(None)
    lines = [f"rank {mesh.rank_of()} (tensor rank {k}):",
             f"  input x {tuple(x.shape)}" + (" (my part of the sequence)" if sp else " (replicated)"),
             f"  ColumnParallelDense kernel {tuple(up.kernel.shape)} = columns {k * 4 * h // t}..{(k + 1) * 4 * h // t - 1}"
             f" of ({h}, {4 * h}); bias {tuple(up.bias.shape)}",
             f"  RowParallelDense    kernel {tuple(down.kernel.shape)} = rows {k * 4 * h // t}..{(k + 1) * 4 * h // t - 1}"
             f" of ({4 * h}, {h}); bias {tuple(down.bias.shape)} replicated",
             f"  hidden after column {tuple(middle.shape)}, output {tuple(y.shape)}",
             "  forward:"]
    for label, kind, shape in log:
        if kind == "backward":
            lines.append("  backward:")
            continue
        n = int(np.prod(shape))
        lines.append(f"    {label:<22} {kind:<14} {str(shape):<12} {n} floats = {4 * n} bytes")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.tensor < 1 or args.hidden % max(args.tensor, 1) or (args.sequence_parallel and args.seq % args.tensor):
        print(f"allreduce-explain megatron-mlp: --tensor {args.tensor} must be >= 1 and divide --hidden "
              f"{args.hidden} (and --seq {args.seq} with --sequence-parallel)", file=sys.stderr)
        return 2
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ and args.tensor > 1:
        return _launch(argv, args.tensor)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tfops
    tfops.init()
    if tfops.size() != args.tensor:
        raise SystemExit(f"megatron-mlp: started on {tfops.size()} ranks, --tensor {args.tensor}: they must match")
    every = tfops.allgather_object(_run(args))
    if tfops.rank() == 0:
        h = args.hidden
        print(f"Megatron MLP block: h={h} -> 4h={4 * h} (gelu) -> h, tensor {args.tensor}, x ({args.batch}, "
              f"{args.seq}, {h}), sequence parallel: {'yes' if args.sequence_parallel else 'no'}")
        print("f = identity forward, allreduce backward; g = allreduce forward, identity backward"
              if not args.sequence_parallel else
              "f = allgather forward, reduce-scatter backward; g = reduce-scatter forward, allgather backward")
        for lines in every:
            print("\n".join(lines))
        if args.tensor == 1:
            print("tensor 1: no collectives (every region operator is the identity)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
