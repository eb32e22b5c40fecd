"""``allreduce-explain ALGORITHM --ranks P --count N``: watch a real algorithm run, step by step.

Examples::

    allreduce-explain ring --ranks 4 --count 8
    allreduce-explain rhd --ranks 3 --count 4 --png rhd3.png
    allreduce-explain ring --collective allgather --ranks 3 --count 3
    python -m allreduce.explain binomial --collective broadcast --ranks 4 --count 2
    allreduce-explain powersgd --ranks 2 --rows 4 --cols 3 --rank 1     (explain/powersgd.py)
    allreduce-explain pipeline --stages 4 --micro-batches 8 --schedule 1f1b   (explain/pipeline.py)
    allreduce-explain megatron-mlp --tensor 2      (tfops/parallel/explain.py: imports tfops lazily, runs mpirun)
"""
from __future__ import annotations

import argparse
import sys

from .symbolic import COLLECTIVES, MAX_RANKS, Unavailable, explain
from .text import render

__all__ = ["main", "build_parser"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    names = sorted({a for algos in COLLECTIVES.values() for a in algos})
    parser = argparse.ArgumentParser(
        prog="allreduce-explain",
        description="Run a collective's real code on in-process ranks with symbolic data and print, "
                    "step by step, who sends which chunk to whom and what every rank holds.")
    parser.add_argument("algorithm", metavar="ALGORITHM", help=f"one of: {', '.join(names)}; or powersgd "
                        "(a comm hook, with options of its own: allreduce-explain powersgd --help)")
    parser.add_argument("--ranks", "-p", type=_int, required=True, metavar="P", help=f"ranks, 1..{MAX_RANKS}")
    parser.add_argument("--count", "-n", type=_int, required=True, metavar="N", help="elements in the buffer")
    parser.add_argument("--collective", choices=tuple(COLLECTIVES), default="allreduce")
    parser.add_argument("--segment-bytes", type=_int, default=256 << 10, metavar="B",
                        help="pipeline segment of ring/tree (default 262144); elements are 8 bytes")
    parser.add_argument("--node-size", type=_int, default=0, metavar="L",
                        help="hierarchical: pretend nodes of L consecutive ranks (default: one node)")
    parser.add_argument("--format", choices=("table", "lines"), default="table",
                        help="states as a ranks x chunks table, or one 'rank r chunk c: ...' line each")
    parser.add_argument("--png", metavar="PATH", help="also draw the steps into a PNG image")
    parser.add_argument("--svg", metavar="PATH", help="also draw the steps into an SVG image")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, print the explanation, write the figures. Returns the exit code.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        0 on success, 1 if the algorithm cannot run on thread ranks here; bad
        arguments exit with code 2 and the usage line (``SystemExit``).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "powersgd":                 # a comm hook, not a collective: its own printout
        from .powersgd import main as powersgd
        return powersgd(argv[1:])
    if argv and argv[0] == "megatron-mlp":             # TensorFlow layers on TENSOR ranks: tfops, imported only here
        from tfops.parallel.explain import main as megatron_mlp
        return megatron_mlp(argv[1:])
    if argv and argv[0] == "pipeline":                 # a schedule, not a collective: its own grid
        from .pipeline import main as pipeline
        return pipeline(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    allowed = COLLECTIVES[args.collective]
    if args.algorithm not in allowed:
        parser.error(f"unknown {args.collective} algorithm {args.algorithm!r}; choose one of: {', '.join(allowed)}")
    if not 1 <= args.ranks <= MAX_RANKS:
        parser.error(f"--ranks must be in 1..{MAX_RANKS} (one letter per rank), got {args.ranks}")
    if args.count < 0:
        parser.error(f"--count must be >= 0, got {args.count}")
    if args.node_size < 0:
        parser.error(f"--node-size must be >= 0, got {args.node_size}")
    if args.segment_bytes < 0:
        parser.error(f"--segment-bytes must be >= 0, got {args.segment_bytes}")
    try:
        trace = explain(args.algorithm, args.ranks, args.count, collective=args.collective,
                        segment_bytes=args.segment_bytes, node_size=args.node_size)
    except Unavailable as exc:
        print(f"allreduce-explain: cannot explain {args.algorithm!r} here: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(render(trace, args.format))
    for path in (args.png, args.svg):
        if path:
            from .draw import draw
            draw(trace, path)
            print(f"wrote {path}")
    return 1 if trace.errors() else 0


if __name__ == "__main__":
    sys.exit(main())
