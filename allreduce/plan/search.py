"""Every (data, tensor, pipeline, ZeRO stage, recompute) layout of N devices, and which fit.

Steps: 1. for every t dividing N (and the heads: a head is not split) and every p dividing
N / t (and the layers: each stage gets L/p), d = N / (t p); 2. the global batch B must split
into d data ranks x m micro-batches x b sequences, so m = B / (d b) (``micro_batch=0``: one
micro-batch of B / d, no accumulation, as Megatron trained in 2019); 3. for each ZeRO stage
0-3 and recompute none / selective / full, count the fullest device's bytes
(:mod:`.memory`) and the step's seconds (:mod:`.time`); 4. a layout fits when its bytes are at
most the device's memory. ZeRO stages 2 and 3 are not combined with a pipeline, as
DeepSpeed's pipeline engine refuses them (gradients are accumulated across micro-batches,
which sharded gradients would reduce-scatter once per micro-batch); nor is a ZeRO stage over a
data group of one rank, which shards nothing.

Cost: (divisors of N)^2 x 12 evaluations; N = 3072 is a few thousand, well under a second.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .memory import RECOMPUTE, Breakdown, Layout, memory
from .model import Params, Precision, Transformer
from .time import Machine, StepTime, step_time

__all__ = ["Plan", "layouts", "evaluate", "search", "divisors"]


@dataclass
class Plan:
    layout: Layout
    memory: Breakdown
    time: StepTime
    fits: bool
    why: list[str] = field(default_factory=list)     #: why not, when it does not fit


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(model: Params | Transformer, devices: int, *, global_batch: int = 0, micro_batch: int = 1,
            tensor: int | None = None, pipeline: int | None = None, zero: tuple[int, ...] = (0, 1, 2, 3),
            recompute: tuple[str, ...] = RECOMPUTE, sequence_parallel: bool = False,
            chunks: int = 1) -> list[Layout]:
    """Every layout allowed by the model's shape, the batch and the pinned sizes (module steps 1-2)."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    is_tf = isinstance(model, Transformer)
    out = []
    for t in divisors(devices):
        if tensor is not None and t != tensor or is_tf and model.heads % t:
            continue
        for p in divisors(devices // t):
            if pipeline is not None and p != pipeline or is_tf and model.layers % p or not is_tf and p > 1:
                continue
            d = devices // (t * p)
            b = micro_batch or (global_batch // d if global_batch else 1)
            if global_batch:
                if global_batch % (d * b):
                    continue
                m = global_batch // (d * b)
            else:
                m = max(1, p)
            for z in zero:
                if z >= 2 and p > 1 or z >= 1 and d == 1:      # a stage over one rank shards nothing
                    continue
                for r in (recompute if is_tf else ("none",)):
                    out.append(Layout(data=d, tensor=t, pipeline=p, zero=z, recompute=r, micro_batch=b,
                                      microbatches=m, sequence_parallel=sequence_parallel and t > 1, chunks=chunks))
    return out


def evaluate(model: Params | Transformer, layout: Layout, precision: Precision, machine: Machine, *,
             extra_grad: float = 0.0, extra_state_sharded: float = 0.0) -> Plan:
    """One layout's bytes and seconds (module step 3) and whether it fits (step 4)."""
    mem = memory(model, layout, precision, extra_grad=extra_grad, extra_state_sharded=extra_state_sharded)
    time = step_time(model, layout, precision, machine, stage_params=mem.params)
    fits = mem.total <= machine.memory
    why = [] if fits else [f"{mem.total:.4g} B > {machine.memory:.4g} B of memory"]
    return Plan(layout, mem, time, fits, why)


def search(model: Params | Transformer, devices: int, precision: Precision, machine: Machine, *,
           feasible_only: bool = True, extra_grad: float = 0.0, extra_state_sharded: float = 0.0,
           **choices) -> list[Plan]:
    """Every layout evaluated, fastest first (in :func:`layouts`' order without a compute rate); with
    ``feasible_only`` only those that fit. ``choices``: :func:`layouts`' keyword arguments."""
    plans = [evaluate(model, lay, precision, machine, extra_grad=extra_grad,
                      extra_state_sharded=extra_state_sharded)
             for lay in layouts(model, devices, **choices)]
    if feasible_only:
        plans = [plan for plan in plans if plan.fits]
    if machine.flops <= 0:
        return plans
    return sorted(plans, key=lambda pl: (pl.time.total, pl.memory.total))
