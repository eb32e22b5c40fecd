"""``allreduce-plan``: which (data, tensor, pipeline, ZeRO, recompute) layouts fit, and how fast.

Examples::

    allreduce-plan --params 7.5e9 --devices 64 --precision mixed          # the ZeRO paper's table
    allreduce-plan --model megatron-8.3b --devices 512 --memory 32GiB --batch 512 --micro-batch 8 \\
        --zero 0 --pipeline 1 --per-node 16 --intra 1200gbit,5us --inter 800gbit,10us --flops 30e12
    allreduce-plan --layers 4 --hidden 256 --heads 4 --seq 128 --vocab 1024 --devices 4 --explain
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from ..algorithms.network import parse_link
from .memory import RECOMPUTE
from .model import PRECISIONS, PRESETS, Params, Transformer
from .search import search
from .time import Machine

__all__ = ["main", "build_parser", "parse_size", "build_model"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> float:
    """Bytes from ``32GiB``, ``80GB``, ``1.5e9``."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)\s*", text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 32GiB, 80GB or 1.5e9 bytes, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _number(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgtp]?)\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a number such as 7.5e9, 60T or 1e12, got {text!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}[m.group(2)]


def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+(?:e-?[0-9]+)?)\s*(s|ms|us|ns)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a time such as 300us, 1.8ms or 2e-4, got {text!r}")
    return float(m.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]


def _host(text: str) -> tuple[float, float, float, float, float]:
    parts = text.split(",")
    if len(parts) not in (3, 5):
        raise argparse.ArgumentTypeError(f"--host takes CALL,OP,UPDATE[,HANDOFF,EXIT] (e.g. 300us,12us,1.8ms or "
                                         f"300us,12us,1.8ms,60us,40us), got {text!r}")
    return tuple(_seconds(x) for x in parts) + (0.0, 0.0)[:5 - len(parts)]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="allreduce-plan", description=(
        "Print every (data, tensor, pipeline, ZeRO stage, recompute) layout of a model on N devices that fits "
        "in memory: bytes per device (weights, gradients, optimizer state, activations), the step time from "
        "the project's alpha-beta-gamma model plus a compute rate, and the pipeline bubble."))
    m = ap.add_argument_group("model (a preset, a parameter count, or a transformer's shape)")
    m.add_argument("--model", choices=sorted(PRESETS))
    m.add_argument("--params", type=_number, help="parameters only (memory of model states, no activations)")
    for name in ("layers", "hidden", "heads", "seq", "vocab", "ffn"):
        m.add_argument(f"--{name}", type=int)
    m.add_argument("--no-dropout", action="store_true", help="no dropout masks are kept")
    m.add_argument("--untied", action="store_true", help="the output layer has weights of its own")
    m.add_argument("--kept", choices=("megatron", "keras"), default="megatron", help="what a layer keeps for "
                   "backward: Korthikanti's count, or Keras layers on TensorFlow (examples/gpt.py)")
    d = ap.add_argument_group("devices")
    d.add_argument("--devices", type=int, required=True, metavar="N")
    d.add_argument("--memory", type=parse_size, default=float("inf"), help="per device: 32GiB, 80GB, ...")
    d.add_argument("--flops", type=_number, default=0.0, help="flops a second one device reaches (60T)")
    d.add_argument("--per-node", type=int, default=1 << 30, help="devices per node (default: one node)")
    d.add_argument("--intra", type=parse_link, help="link inside a node: 1200gbit,5us (default: this "
                   "machine's measured cost model)")
    d.add_argument("--inter", type=parse_link, help="link between nodes: 200gbit,10us")
    d.add_argument("--in-step", type=parse_link, metavar="LINK", help="inside a node, the link tensor "
                   "parallelism's allreduces see, many in a row inside one compiled step (benchmarks/plan_bench.py "
                   "measures it): 4gbit,190us (default: --intra)")
    t = ap.add_argument_group("training")
    t.add_argument("--precision", choices=sorted(PRECISIONS), default="mixed")
    t.add_argument("--batch", type=int, default=0, help="global batch, in sequences")
    t.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch; 0: the whole "
                   "batch of a data rank at once (no accumulation)")
    t.add_argument("--tensor", type=int)
    t.add_argument("--pipeline", type=int)
    t.add_argument("--zero", type=_ints, default=(0, 1, 2, 3), help="stages to try: 0,1,2,3")
    t.add_argument("--recompute", type=lambda s: tuple(s.split(",")), default=RECOMPUTE,
                   help="none,selective,full")
    t.add_argument("--sequence-parallel", action="store_true")
    t.add_argument("--chunks", type=int, default=1, help="interleaved stages per device (v)")
    t.add_argument("--extra-grad", type=float, default=0.0, help="bytes a parameter an implementation keeps "
                   "beyond the formula at ZeRO 0-1 (tfops' DistributedOptimizer: 4, the reduced copy)")
    t.add_argument("--extra-state", type=float, default=0.0, help="bytes a parameter / d at ZeRO 1-2 beyond the "
                   "formula (tfops' ShardedOptimizer: 4, the inner optimizer's copy of the slice)")
    t.add_argument("--host", type=_host, default=(0.0,) * 5, metavar="CALL,OP,UPDATE[,HANDOFF,EXIT]",
                   help="the host's fixed costs: a call into compiled code, an eager op, an eager optimizer "
                   "update of one weight tensor, and for ZeRO 3 a hand-off to a worker thread and back and a "
                   "numpy_function exit (e.g. 300us,12us,1.8ms,60us,40us; default: not counted)")
    o = ap.add_argument_group("output")
    o.add_argument("--all", action="store_true", help="also the layouts that do not fit")
    o.add_argument("--top", type=int, default=20, help="rows to print (0: all)")
    o.add_argument("--units", choices=("GB", "GiB", "MiB", "MB"), default="GB")
    o.add_argument("--explain", action="store_true", help="the arithmetic of each printed row, line by line")
    o.add_argument("--json", action="store_true")
    return ap


def build_model(args) -> Params | Transformer:
    shape = [args.layers, args.hidden, args.heads, args.seq, args.vocab]
    given = sum(x is not None for x in (args.model, args.params)) + (any(v is not None for v in shape))
    if given != 1:
        raise SystemExit("allreduce-plan: give exactly one of --model, --params, or "
                         "--layers/--hidden/--heads/--seq/--vocab")
    if args.model:
        return PRESETS[args.model]
    if args.params is not None:
        return Params(int(args.params))
    if any(v is None for v in shape):
        raise SystemExit("allreduce-plan: a transformer needs all of --layers --hidden --heads --seq --vocab")
    try:
        return Transformer(*shape, ffn=args.ffn or 0, dropout=not args.no_dropout, tied=not args.untied,
                           kept=args.kept, name="transformer")
    except ValueError as exc:
        raise SystemExit(f"allreduce-plan: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = build_model(args)
    precision = PRECISIONS[args.precision]
    if (args.intra is None) != (args.inter is None) and args.per_node < args.devices:
        raise SystemExit("allreduce-plan: give both --intra and --inter (or neither: this machine's model)")
    bad = [r for r in args.recompute if r not in RECOMPUTE]
    if bad:
        raise SystemExit(f"allreduce-plan: --recompute takes {','.join(RECOMPUTE)}, not {bad[0]!r}")
    call, eager_op, eager_update, handoff, graph_exit = args.host
    machine = Machine(flops=args.flops, memory=args.memory, per_node=args.per_node,
                      intra=args.intra or args.inter, inter=args.inter, call=call, eager_op=eager_op,
                      eager_update=eager_update, handoff=handoff, graph_exit=graph_exit, in_step=args.in_step)
    plans = search(model, args.devices, precision, machine, feasible_only=not args.all,
                   extra_grad=args.extra_grad, extra_state_sharded=args.extra_state,
                   global_batch=args.batch, micro_batch=args.micro_batch, tensor=args.tensor,
                   pipeline=args.pipeline, zero=args.zero, recompute=args.recompute,
                   sequence_parallel=args.sequence_parallel, chunks=args.chunks)
    shown = plans[:args.top] if args.top else plans
    if args.json:
        json.dump([_row(p) for p in shown], sys.stdout, indent=1)
        print()
        return 0
    _print(model, args, precision, plans, shown)
    return 0


def _row(plan) -> dict:
    lay, mem = plan.layout, plan.memory
    return {"data": lay.data, "tensor": lay.tensor, "pipeline": lay.pipeline, "zero": lay.zero,
            "recompute": lay.recompute, "microbatches": lay.microbatches, "weights": mem.weights,
            "grads": mem.grads, "state": mem.state, "activations": mem.activations, "total": mem.total,
            "stage": mem.stage, "step_s": plan.time.total, "bubble": plan.time.bubble, "fits": plan.fits}


def _print(model, args, precision, plans, shown) -> None:
    scale = _UNITS[args.units.lower()]
    mem = "unlimited" if args.memory == float("inf") else f"{args.memory / scale:.4g} {args.units}"
    print(model.describe())
    print(f"{args.devices} devices, {mem} each; {precision.name}: weights {precision.weight} + gradients "
          f"{precision.grad} + optimizer {precision.state} bytes a parameter"
          + (f"; global batch {args.batch}, micro-batch {args.micro_batch or 'B/d'}" if args.batch else ""))
    print(f"{sum(p.fits for p in plans)} layout(s) fit" + (f" of {len(plans)}" if args.all else "")
          + (f"; the first {len(shown)}" if len(shown) < len(plans) else "")
          + ("" if args.flops else "; no --flops: step not timed, layouts in order"))
    head = (f"{'data':>5} {'tensor':>6} {'pipe':>4} {'zero':>4} {'recompute':>9} | {'weights':>8} {'grads':>8} "
            f"{'optim':>8} {'activ':>8} {'total':>8} {args.units:<3} | {'step s':>9} {'bubble':>6}")
    print(head)
    for plan in shown:
        lay, m = plan.layout, plan.memory
        vals = " ".join(f"{v / scale:8.{_digits(v / scale)}f}" for v in (m.weights, m.grads, m.state,
                                                                            m.activations, m.total))
        step = f"{plan.time.total:9.4g}" if args.flops else f"{'-':>9}"
        flag = "" if plan.fits else "  does not fit"
        print(f"{lay.data:>5} {lay.tensor:>6} {lay.pipeline:>4} {lay.zero:>4} {lay.recompute:>9} | {vals}     "
              f"| {step} {plan.time.bubble:6.3f}{flag}")
        if args.explain:
            for line in m.lines + list(plan.time.lines):
                print(f"      {line}")


def _digits(v: float) -> int:
    return 1 if abs(v) >= 1 else (2 if abs(v) >= 0.1 else 3)


if __name__ == "__main__":
    sys.exit(main())
