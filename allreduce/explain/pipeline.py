"""``allreduce-explain pipeline``: print a pipeline schedule as a grid, rank by time slot.

Examples::

    allreduce-explain pipeline --stages 4 --micro-batches 8 --schedule 1f1b
    allreduce-explain pipeline --stages 4 --micro-batches 8 --schedule interleaved --chunks 2
    allreduce-explain pipeline --stages 2 --micro-batches 4 --schedule gpipe --actions

The grid comes from :func:`allreduce.schedules.simulate` over the same per-rank lists
(:func:`allreduce.schedules.stage_actions`) that ``tfops.parallel.Pipeline`` executes. A cell
``F3`` is the forward of micro-batch 3, ``B3`` its backward; with chunks, ``F3b`` is micro-batch 3
on the rank's second chunk; ``.`` is an idle slot: the bubble.
"""
from __future__ import annotations

import argparse
import string
import sys

from ..errors import InvalidArgumentError
from ..schedules.grid import Grid, check_messages, simulate
from ..schedules.pipeline import SCHEDULES, stage_actions

__all__ = ["main", "render"]


def _label(kind: str, i: int, c: int, v: int) -> str:
    return f"{kind}{i}{string.ascii_lowercase[c] if v > 1 else ''}"


def render(grid: Grid) -> str:
    """The grid as text: a header, one row per rank, then the counts and the formula."""
    p, m, v, span = grid.p, grid.m, grid.v, grid.makespan
    width = max(len(_label("F", m - 1, v - 1, v)), len(str(span - 1))) + 1
    lines = [f"pipeline {grid.name}: p = {p} stages, m = {m} micro-batches, v = {v} chunk{'s' * (v > 1)} "
             f"a rank (F = {grid.forward} slot{'s' * (grid.forward > 1)}, "
             f"B = {grid.backward} slot{'s' * (grid.backward > 1)})", ""]
    lines.append("slot    |" + "".join(f"{t:>{width}}" for t in range(span)))
    for r in range(p):
        row = ["."] * span
        for cell in grid.cells[r]:
            for t in range(cell.start, cell.end):
                row[t] = _label(cell.kind, cell.micro_batch, cell.chunk, v)
        lines.append(f"stage {r:<2}|" + "".join(f"{x:>{width}}" for x in row))
    lines += ["", "stage  busy  idle  idle/busy  (p-1)/(v m)  peak live activations"]
    for r in range(p):
        lines.append(f"{r:>5} {grid.busy(r):>5} {grid.idle(r):>5} {grid.bubble(r):>10.3f} {grid.formula:>12.3f}"
                     f"  {grid.peak[r]:>5} (micro-batch, chunk) pairs")
    lines.append(f"bubble: {sum(grid.idle(r) for r in range(p))} idle of {p * span} rank-slots; "
                 f"messages a rank a step: {2 * m * v} each way at most")
    return "\n".join(lines) + "\n"


def _actions(name: str, p: int, m: int, v: int) -> str:
    return "".join(f"stage {r}: " + " ".join(str(a) for a in stage_actions(name, p, m, r, v)) + "\n"
                   for r in range(p))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (without ``pipeline``), print the grid. Returns the exit code (bad arguments:
    exit 2 with the usage line)."""
    parser = argparse.ArgumentParser(prog="allreduce-explain pipeline",
                                     description="Print a pipeline schedule, stage by time slot, with its bubble.")
    parser.add_argument("--stages", "-p", type=_int, required=True, metavar="P")
    parser.add_argument("--micro-batches", "-m", type=_int, required=True, metavar="M")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--chunks", "-v", type=_int, default=None, metavar="V",
                        help="model chunks a rank (interleaved only; default 2 there, 1 otherwise)")
    parser.add_argument("--forward-slots", type=_int, default=1, metavar="N")
    parser.add_argument("--backward-slots", type=_int, default=1, metavar="N")
    parser.add_argument("--actions", action="store_true",
                        help="also list each rank's actions with its sends and receives, as the runtime runs them")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    v = args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)
    if args.stages > 64 or args.micro_batches > 256:
        parser.error("at most 64 stages and 256 micro-batches (the grid is printed)")
    if args.forward_slots < 1 or args.backward_slots < 1:
        parser.error("--forward-slots and --backward-slots must be >= 1")
    try:
        grid = simulate(args.schedule, args.stages, args.micro_batches, v,
                        forward=args.forward_slots, backward=args.backward_slots)
        check_messages(args.schedule, args.stages, args.micro_batches, v)
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    sys.stdout.write(render(grid))
    if args.actions:
        sys.stdout.write("\n" + _actions(args.schedule, args.stages, args.micro_batches, v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
