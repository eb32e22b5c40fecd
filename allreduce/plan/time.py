"""Seconds per training step for one layout: compute, the pipeline's bubble, and the messages.

    T = F / (d t p) / R x (1 + (p - 1) / (v m))        compute, stretched by the bubble
      + T_dp                                           the data group's gradient exchange
      + m x (n_tp x L/p + 2) x T_allreduce(s b h e, t)  tensor parallelism's allreduces
      + m x 3 x T_allreduce(4 s b, t)                  ... and the vocabulary-parallel loss's
      + 2 m x T_send(s b h e)                          pipeline sends, forward and back
      + calls x c + ops x e + tensors x u              the host's own work (when measured)
      + m x units x (3 h + 2 x)                        ... and stage 3's hand-offs and exits

* F, the step's flops: 3 forward passes' worth (forward, and backward at twice it;
  Narayanan et al. 2021, eq. 3), plus a fourth forward of the layers under full recompute, or
  the attention core's QK^T and AV again under selective recompute. R is the rate one device
  reaches (flops a second), an input: measure it or take a fraction of the datasheet's.
* The bubble (p - 1) / (v m) of 1F1B with v interleaved chunks and m micro-batches.
* T_dp: an allreduce of the stage's gradient bytes over d ranks once a step at ZeRO 0-1 (stage
  1 sends a reduce-scatter and an allgather: the same bytes). Sharded gradients cannot wait
  for the last micro-batch, so stage 2 reduce-scatters every micro-batch ((m + 1) / 2
  allreduces with the allgather) and stage 3 also gathers the weights for every forward and
  backward (1.5 m). Stage 3 runs its collectives a unit at a time (FSDP, DeepSpeed and tfops'
  ``fully_shard`` alike): a transformer's stage is L/p layers + the units outside them
  (``Transformer.edge_units``: Megatron's embedding and head, 2; Keras layers, which
  ``fully_shard`` wraps one by one, the token and position embeddings, the final norm and the
  untied head, 4), so it pays the latency once per unit: 1.5 m x units x T_allreduce(bytes / units).
* n_tp: 2 allreduces per layer forward and 2 backward (Megatron's f and g), 2 more under full
  recompute; and 2 outside the layers (the vocabulary-parallel embedding's g forward, the head's f
  backward). The vocabulary-parallel loss adds 3 allreduces of s b numbers (the rows' max, the
  target's logit, the sum of exponentials). Sequence parallelism swaps each for an allgather and
  a reduce-scatter: the same bytes.

* The host: what the CPU that drives the device spends per dispatch, whatever the bytes and
  flops (the fixed cost a GPU pays as kernel launches). ``c``: one call into compiled code;
  ``e``: one eager op; ``u``: an eager optimizer update of one weight tensor (Adam). A compiled
  step is 1 call (its collectives' exits from the graph are inside their measured alpha). A
  pipeline stage runs its schedule from the host: per micro-batch a forward call and a backward
  call (2m), its gradients summed over the micro-batches op by op (m x tensors eager ops), and
  the optimizer applied eagerly (tensors x u); its sends are priced as messages. Stage 3 (tfops'
  ``fully_shard``) runs each unit's three collectives on a worker thread, each handed over from
  a ``numpy_function`` in the compiled step and waited for (``h``: one hand-off to a thread and
  back), and leaves the graph twice more per unit than its collectives do (``x``: one
  ``numpy_function`` exit; the weights' release, and the reduce-scatter's wait beside its
  hand-over): m x units x (3 h + 2 x), the units counted as in T_dp. A collective's own exit is
  in the direct path's measured alpha. ``c``, ``e``, ``u``, ``h`` and ``x`` are inputs (0: not
  counted; the benchmark measures them on the machine it predicts, as it measures the matmul
  rate).

No overlap is assumed: each term is paid in full, an upper bound on a step.

The collectives are priced by the project's own cost model, not a second one: on this machine
(no links given) an allreduce costs what :func:`allreduce.algorithms.select.ranked` predicts
for its fastest candidate (the measured table where it has the world size, else the fitted
alpha-beta-gamma lines), a send the ring's alpha + n beta. With links given
(``network.parse_link``: "300gbit,5us"), an allreduce is the ring's terms (``select.terms``)
over the slowest link its group crosses, as ``network.cross_terms`` counts the bytes through
a host's link. Rank order is Megatron's: tensor fastest, then data, then pipeline.

Tensor parallelism's allreduces follow one another inside one compiled step (f, g, f, g, ...),
so none of them pays a call into compiled code, or the first collective's wait for the last rank,
of its own. ``Machine.in_step`` is the link they see there, measured as the split layers issue
them (``plan_bench.py``: k allreduces in a row in one ``tf.function``, for two k; the difference
/ the difference in k is one message). On this 2-core machine (three runs, 2026-12-07 18:56-19:01
UTC, -np 4; the median over the ranks) that is 145-243 us a ring message, 0.9-1.5 ms an
allreduce over 4 ranks, and a split layer's 512 KiB at most 0.03 ms more than 4 bytes; one
allreduce per compiled call reads 351-491 us a message, 2.1-2.9 ms an allreduce. None: ``intra``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..algorithms import network, select
from .memory import Layout
from .model import Params, Precision, Transformer

__all__ = ["Machine", "StepTime", "step_time", "allreduce_seconds", "send_seconds", "bubble", "zero3_units",
           "host_counts"]

#: the candidates ``auto`` weighs on one node (``Communicator.auto_candidates``)
LOCAL_CANDIDATES = ("ring", "tree", "rhd", "rd", "mpi", "shm")


@dataclass(frozen=True)
class Machine:
    """The devices: ``flops`` a second each, ``per_node`` to a node, and the links between them.

    ``intra`` / ``inter``: :class:`allreduce.algorithms.network.Link` inside a node and between
    nodes; None prices every collective by this machine's measured cost model (one node).
    ``gradients``: on one node, the link the data group's gradient exchange at ZeRO 0-2 sees when
    its path differs from the layers' collectives (tfops queues it through the engine, whose cycle
    and negotiation add latency that a tensor region's direct call does not pay); None: ``intra``."""

    flops: float = 0.0
    memory: float = float("inf")
    per_node: int = 1 << 30
    intra: network.Link | None = None
    inter: network.Link | None = None
    gradients: network.Link | None = None
    call: float = 0.0          #: host seconds of one dispatch (a compiled call, a collective's exit, a message)
    eager_op: float = 0.0      #: host seconds of one eager op
    eager_update: float = 0.0  #: host seconds of an eager optimizer update of one weight tensor
    handoff: float = 0.0       #: host seconds of one hand-off to a worker thread and back (stage 3's collectives)
    graph_exit: float = 0.0    #: host seconds of one numpy_function exit from compiled code
    in_step: network.Link | None = None   #: on one node, tensor parallelism's link inside a step; None: intra


@dataclass
class StepTime:
    compute: float = 0.0
    bubble: float = 0.0              #: fraction of compute added: (p - 1) / (v m)
    data: float = 0.0
    tensor: float = 0.0
    pipeline: float = 0.0
    host: float = 0.0
    lines: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return self.compute * (1 + self.bubble) + self.data + self.tensor + self.pipeline + self.host


def bubble(layout: Layout) -> float:
    return (layout.pipeline - 1) / (layout.chunks * layout.microbatches)


def allreduce_seconds(nbytes: float, group: int, machine: Machine, *, nodes: int = 1,
                      link: network.Link | None = None) -> float:
    """One allreduce of ``nbytes`` over ``group`` ranks on ``nodes`` nodes (the module docstring);
    ``link``: the one-node link to price it by instead of ``machine.intra``."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    link = link if link is not None and nodes <= 1 else machine.intra
    if link is None:
        return select.ranked(int(nbytes), group, candidates=LOCAL_CANDIDATES)[0][1]
    if nodes > 1 and machine.inter is not None:
        a, b = network.cross_terms("ring", group, nodes)
        return a * machine.inter.alpha + b * nbytes * machine.inter.beta
    a, b, _ = select.terms("ring", group)
    return a * link.alpha + b * nbytes * link.beta


def send_seconds(nbytes: float, machine: Machine, *, spans_nodes: bool = False) -> float:
    """One message of ``nbytes`` between two ranks."""
    link = machine.inter if spans_nodes and machine.inter is not None else machine.intra
    if link is None:
        c = select.constants()["ring"]
        return c["alpha"] + nbytes * c["beta"]
    return link.alpha + nbytes * link.beta


def _dp_allreduces(zero: int, m: int) -> tuple[float, str]:
    """Allreduces' worth of the data group's traffic per step, and why (a reduce-scatter or an
    allgather is half an allreduce's bytes). Sharded gradients cannot be accumulated unreduced, so
    stages 2 and 3 reduce-scatter every micro-batch, as DeepSpeed does; stage 3 also gathers the
    weights for every micro-batch's forward and backward."""
    if zero <= 1:
        return 1.0, "once a step: gradients accumulate over the micro-batches first"
    if zero == 2:
        return (m + 1) / 2, f"a reduce-scatter per micro-batch x {m} + one allgather of the weights"
    return 1.5 * m, f"per micro-batch x {m}: gather weights twice, reduce-scatter the gradients"


def zero3_units(model: Params | Transformer, layout: Layout) -> int:
    """Units the fullest stage gathers and reduce-scatters one at a time at ZeRO 3: its L/p layers
    and the units outside them (``Transformer.edge_units``; the larger edge's in a pipeline); 1
    below stage 3, or for a model known only by its parameter count."""
    if layout.zero < 3 or not isinstance(model, Transformer):
        return 1
    first, last = model.edge_units()
    p = layout.pipeline
    return -(-model.layers // p) + (first + last if p == 1 else max(first, last))


@dataclass(frozen=True)
class HostCounts:
    """The host's dispatches in one step of the fullest stage (the module docstring)."""
    calls: float
    ops: float
    updates: float
    handoffs: float
    exits: float
    why: str


def host_counts(model: Transformer, layout: Layout) -> HostCounts:
    """Calls into compiled code, eager ops, eager optimizer updates, stage 3's hand-offs to its
    worker thread and its extra ``numpy_function`` exits, and the reason in words."""
    p, m = layout.pipeline, layout.microbatches
    if p == 1:
        units = zero3_units(model, layout) if layout.zero == 3 else 0
        why = "1 compiled step" + (f", {m} micro-batches x {units} units x (3 hand-offs + 2 exits)" if units else "")
        return HostCounts(1.0, 0.0, 0.0, 3.0 * m * units, 2.0 * m * units, why)
    first, last = model.edge_tensors()
    tensors = -(-model.layers // p) * model.layer_tensors() + max(first, last)
    return HostCounts(2.0 * m, float(m * tensors), float(tensors), 0.0, 0.0,
                      f"{m} micro-batches x (a forward and a backward call), {tensors} weight tensors summed over "
                      f"the micro-batches and updated eagerly")


def step_flops(model: Transformer, layout: Layout, global_batch: int) -> float:
    """Flops of one step over ``global_batch`` sequences, all devices together."""
    fwd = model.forward_flops(global_batch)
    total = 3 * fwd
    if layout.recompute == "full":
        total += fwd - 2 * global_batch * model.seq * model.hidden * model.vocab     # the layers again
    elif layout.recompute == "selective":
        total += model.layers * model.attention_core_flops(global_batch)
    return total


def step_time(model: Params | Transformer, layout: Layout, precision: Precision, machine: Machine, *,
              stage_params: float) -> StepTime:
    """Seconds of one step; ``stage_params``: parameters the fullest stage owns (before ZeRO)."""
    t, p, d, m = layout.tensor, layout.pipeline, layout.data, layout.microbatches
    out, lines = StepTime(bubble=bubble(layout)), []
    grad_bytes = stage_params * precision.grad
    dp_nodes = -(-d // max(1, machine.per_node // t))       # a data group's ranks are t apart
    units = zero3_units(model, layout)
    ar = allreduce_seconds(grad_bytes / units, d, machine, nodes=dp_nodes,
                           link=machine.gradients if layout.zero < 3 else None)
    times, why = _dp_allreduces(layout.zero, m)
    out.data = ar * times * units
    per = f" / {units} units" if units > 1 else ""
    inside = -(-model.layers // p) if units > 1 else 0
    each = f" x {units} units ({inside} layers + {units - inside} outside them)" if units > 1 else ""
    lines.append(f"data: allreduce of {grad_bytes:.4g} B{per} over d {d}{f' on {dp_nodes} nodes' if dp_nodes > 1 else ''}"
                 f" = {ar * 1e3:.4g} ms, x {times:g} ({why}){each} = {out.data * 1e3:.4g} ms")
    if isinstance(model, Transformer):
        global_batch = d * m * layout.micro_batch
        flops = step_flops(model, layout, global_batch)
        per_device = flops / (d * t * p)
        out.compute = per_device / machine.flops if machine.flops > 0 else 0.0
        lines.append(f"compute: {flops:.4g} flops for a global batch of {global_batch} / {d * t * p} devices / "
                     f"{machine.flops:.4g} flop/s = {out.compute * 1e3:.4g} ms, x (1 + bubble {out.bubble:.3g})")
        act = model.seq * layout.micro_batch * model.hidden * precision.activation
        n_tp = 6 if layout.recompute == "full" else 4
        layers = -(-model.layers // p)
        tp_nodes = -(-t // machine.per_node)
        tp_one = allreduce_seconds(act, t, machine, nodes=tp_nodes, link=machine.in_step)
        loss_one = allreduce_seconds(4 * model.seq * layout.micro_batch, t, machine, nodes=tp_nodes,
                                     link=machine.in_step)
        out.tensor = m * ((n_tp * layers + 2) * tp_one + 3 * loss_one)
        if t > 1:
            by = f", in a step: {machine.in_step}" if machine.in_step is not None and tp_nodes <= 1 else ""
            lines.append(f"tensor: {m} micro-batches x ((({n_tp} allreduces x {layers} layers + 2) x "
                         f"{tp_one * 1e3:.4g} ms ({act:.4g} B over t {t}{by}) + 3 x {loss_one * 1e3:.4g} ms "
                         f"(the loss's)) = {out.tensor * 1e3:.4g} ms")
        if p > 1:
            one = send_seconds(act, machine, spans_nodes=t * d >= machine.per_node)
            out.pipeline = 2 * m * one
            lines.append(f"pipeline: 2 x {m} micro-batches x {one * 1e3:.4g} ms a send of {act:.4g} B = "
                         f"{out.pipeline * 1e3:.4g} ms")
        if machine.call or machine.eager_op or machine.eager_update or machine.handoff or machine.graph_exit:
            n = host_counts(model, layout)
            out.host = (n.calls * machine.call + n.ops * machine.eager_op + n.updates * machine.eager_update
                        + n.handoffs * machine.handoff + n.exits * machine.graph_exit)
            stage3 = (f" + {n.handoffs:g} hand-offs x {machine.handoff * 1e6:.4g} us + {n.exits:g} exits x "
                      f"{machine.graph_exit * 1e6:.4g} us" if n.handoffs or n.exits else "")
            lines.append(f"host: {n.why}: {n.calls:g} calls x {machine.call * 1e6:.4g} us + {n.ops:g} eager ops x "
                         f"{machine.eager_op * 1e6:.4g} us + {n.updates:g} eager updates x "
                         f"{machine.eager_update * 1e6:.4g} us{stage3} = {out.host * 1e3:.4g} ms")
    lines.append(f"step: {out.total * 1e3:.4g} ms")
    out.lines = tuple(lines)
    return out
