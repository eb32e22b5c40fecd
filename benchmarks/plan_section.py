"""The planner's side of benchmarks/plan_bench.py: its prediction for each measured row, the table.

    predict(row)      allreduce-plan's bytes and seconds for the layout a row ran
    compare(rows)     per configuration, the fullest rank's counts beside the prediction
    render(saved)     the BENCHMARKS.md section (counts, errors, predicted vs measured step order)

The model is the example's: float32 Adam, no dropout, untied head, Keras layers (``kept="keras"``);
tfops keeps the inner optimizer's copy of the slice at stages 1-2 (4 bytes a parameter, sharded)
and its stage 3 re-runs every unit in backward (recompute "full"). The machine is the run's own:
the median over its rows of the matmul rate and of the alpha and beta its allreduces took, by
the engine (the data group's gradients at ZeRO 0-2) and by a direct call (every other collective),
one per compiled call; and of the direct call's many in a row inside one compiled call, which prices
tensor parallelism's allreduces (``Machine.in_step``).
"""
from __future__ import annotations

import statistics

MIB = float(1 << 20)
MICRO_BATCHES = 4                 #: per step, for the pipeline configurations (gpt.py --micro-batches)
IN_STEP = (4, 20)                 #: allreduces in a row in one compiled call (plan_bench._in_step), two k

__all__ = ["predict", "run_machine", "compare", "orders", "ordering_agrees", "render"]


def predict(row: dict, machine=None) -> dict:
    """The planner's bytes and seconds for one measured row's layout (float32 Adam; the example's
    model: no dropout, untied head, Keras layers; tfops keeps the inner optimizer's copy of the slice
    at stages 1-2, and its stage 3 re-runs every unit in backward: recompute "full")."""
    from allreduce.plan import PRECISIONS, Layout, Machine, Transformer, memory, step_time
    from allreduce.plan.time import zero3_units
    fp32 = PRECISIONS["fp32"]
    model = Transformer(row["layers"], row["hidden"], row["heads"], row["seq"], row["vocab"], dropout=False,
                        tied=False, kept="keras", name="examples/gpt.py")
    p, m = row.get("pipeline", 1), row.get("micro_batches", 1)
    lay = Layout(data=row["data"], tensor=row["tensor"], pipeline=p, zero=row["zero"],
                 recompute="full" if row["zero"] == 3 else "none", micro_batch=row["rows"] // m, microbatches=m)
    mem = memory(model, lay, fp32, extra_state_sharded=4.0)
    st = step_time(model, lay, fp32, machine or run_machine([row]), stage_params=mem.params)
    return {"weights": mem.weights, "grads": mem.grads, "state": mem.state, "activations": mem.activations,
            "total": mem.total, "step_s": st.total, "params": mem.params, "stage": mem.stage, "layout": lay.label(),
            "units": zero3_units(model, lay)}


def run_machine(rows: list[dict]):
    """The planner's Machine for a run: the median over its rows of the matmul rate and, where the run
    measured them, of its two paths' alpha and beta (else select.py's table prices them), of the
    direct path's inside a compiled step (tensor parallelism's allreduces) and of the host's fixed
    costs (a compiled call, an eager op, an eager Adam update of one weight, a hand-off
    to a worker thread and back, a numpy_function exit)."""
    from allreduce.algorithms.network import Link
    from allreduce.plan import Machine
    flops = statistics.median(r["flops"] for r in rows)
    host = {key: statistics.median(r[key + "_s"] for r in rows)
            for key in ("call", "eager_op", "eager_update", "handoff", "graph_exit") if all(key + "_s" in r for r in rows)}
    if not all("alpha_direct" in r for r in rows):
        return Machine(flops=flops, **host)

    def link(suffix: str) -> Link:
        return Link(statistics.median(r["alpha" + suffix] for r in rows),
                    statistics.median(r["beta" + suffix] for r in rows), "measured")
    in_step = link("_in_step") if all("alpha_in_step" in r for r in rows) else None
    return Machine(flops=flops, intra=link("_direct"), gradients=link(""), in_step=in_step, **host)


def compare(rows: list[dict]) -> list[dict]:
    """One line per configuration: the fullest rank's counts (max over ranks) beside the prediction.
    At ZeRO 3 the counted weights add the whole weights of the two largest consecutive units (the
    one running and the one prefetched), from the live units' shapes."""
    out, machine = [], run_machine(rows)
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        top = max(mine, key=lambda r: r["weights"] + r.get("gathered", 0) + r["state"] + r["activations"])
        pred = predict(top, machine)
        weights = top["weights"] + top.get("gathered", 0)
        counted = weights + pred["grads"] + top["state"] + top["activations"]
        out.append({"config": name, "np": top["np"], "tensor": top["tensor"], "data": top["data"],
                    "pipeline": top.get("pipeline", 1), "zero": top["zero"], "pred": pred, "weights": weights,
                    "state": top["state"], "activations": top["activations"], "counted": counted,
                    "error": counted / pred["total"] - 1, "base": max(r["base"] for r in mine),
                    "peak_above": max(r["peak_above"] for r in mine), "rank": top["rank"],
                    "in_flight": top.get("in_flight"), "rebuilt": top.get("rebuilt", 0), "units": top.get("units"),
                    "step_s": statistics.median(r["step_s"] for r in mine), "flops": top["flops"]})
    return out


def orders(lines: list[dict]) -> tuple[list[str], list[str]]:
    """The configurations fastest first: as the planner predicts them, and as they were measured."""
    return ([ln["config"] for ln in sorted(lines, key=lambda ln: ln["pred"]["step_s"])],
            [ln["config"] for ln in sorted(lines, key=lambda ln: ln["step_s"])])


def ordering_agrees(lines: list[dict], *, margin: float = 0.25) -> list[tuple[str, str, bool]]:
    """Every pair whose predicted step times differ by more than ``margin``: does the measured order agree?"""
    out = []
    for i, a in enumerate(lines):
        for b in lines[i + 1:]:
            fast, slow = (a, b) if a["pred"]["step_s"] <= b["pred"]["step_s"] else (b, a)
            if slow["pred"]["step_s"] > (1 + margin) * fast["pred"]["step_s"]:
                out.append((fast["config"], slow["config"], fast["step_s"] < slow["step_s"]))
    return out


def _runs(saved: dict) -> str:
    """The command(s) behind the rows, each with its time and load (a file may merge two launches)."""
    runs = saved.get("runs") or [{k: saved[k] for k in ("command", "when", "load")}]
    return "; then ".join(f"`{r['command']}` ({r['when']}, load {r['load']})" for r in runs)


def _units(lines: list[dict]) -> str:
    """Stage 3's units as the planner counts them, and as the run's fully_shard made them."""
    z3 = [ln for ln in lines if ln["zero"] == 3]
    return "; ".join(f"{ln['config']}: {ln['pred']['units']} units priced, {ln['units']} in the run"
                     for ln in z3) or "no stage-3 configuration"


def render(saved: dict) -> str:
    lines = compare(saved["rows"])
    machine = run_machine(saved["rows"])
    a = saved["args"]
    out = ["## The planner's predictions against the GPT example (issue 44)", "",
           f"{_runs(saved)}: examples/gpt.py with {a['layers']} layers, "
           f"hidden {a['hidden']}, {a['heads']} heads, sequence {a['seq']}, global batch {a['batch']}, float32 Adam, "
           f"-np {lines[0]['np'] if lines else '?'}, every configuration in the same ranks one after another "
           f"(pipeline: 1F1B, {a.get('micro_batches', MICRO_BATCHES)} micro-batches). MiB per rank, the fullest rank. "
           "*Counted*: weights and optimizer state from the live variables (ZeRO 3: the shards plus the whole "
           "weights of the two largest consecutive units, running and prefetched); activations = the forward "
           "tensors the backward pass reads in the traced step (benchmarks/plan_counts.py), at ZeRO 3 plus what "
           "the largest recomputed unit keeps in backward, in a pipeline the traced chunk's count for one "
           "micro-batch x the most micro-batches the schedule held in flight. Gradients: the planner's figure in "
           "both columns (not a live object after the step). *Peak above base*: VmHWM less VmRSS before the model "
           "was built, MALLOC_MMAP_THRESHOLD_=131072; base = TensorFlow's runtime and what earlier configurations "
           "left. Step: median measured; predicted from the planner with the rate a matmul reached in the same "
           "run" + (", and the host's fixed costs measured in it too: a compiled call "
                    f"{machine.call * 1e6:.0f} us, an eager op {machine.eager_op * 1e6:.0f} us, an eager Adam update "
                    f"of one weight {machine.eager_update * 1e6:.0f} us" + (
                        f", a hand-off to a worker thread and back {machine.handoff * 1e6:.0f} us and a numpy_function "
                        f"exit {machine.graph_exit * 1e6:.0f} us (stage 3: 3 and 2 per unit and micro-batch, "
                        f"{_units(lines)})" if machine.handoff or machine.graph_exit else "")
                    + " (allreduce/plan/time.py's host term)"
                    if machine.call else " (no host costs measured: the run predates them)") + "."
           + (f" Tensor parallelism's allreduces are priced by the direct path inside a compiled step: "
              f"{machine.in_step.alpha * 1e6:.0f} us a message and " + (
                  f"{8 / machine.in_step.beta / 1e9:.3g} Gbit/s" if machine.in_step.beta > 0 else
                  f"nothing measurable a byte ({4 * a['seq'] * a['batch'] * a['hidden'] >> 10} KiB no slower than 4 B)")
              + f" (the ring's terms fitted to {IN_STEP[1]} less {IN_STEP[0]} allreduces in a row in one call; "
              f"one allreduce per call: {machine.intra.alpha * 1e6:.0f} us a message and "
              f"{8 / machine.intra.beta / 1e9:.3g} Gbit/s)." if machine.in_step is not None else ""), "",
           "| config | weights pred / counted | state pred / counted | activations pred / counted | total pred / "
           "counted | error | peak above base (base) | step s pred / measured |",
           "|---|---|---|---|---|---|---|---|"]
    for ln in lines:
        p = ln["pred"]
        out.append(f"| {ln['config']} (d{ln['data']}) | {p['weights'] / MIB:.2f} / {ln['weights'] / MIB:.2f} | "
                   f"{p['state'] / MIB:.2f} / {ln['state'] / MIB:.2f} | {p['activations'] / MIB:.2f} / "
                   f"{ln['activations'] / MIB:.2f} | {p['total'] / MIB:.2f} / {ln['counted'] / MIB:.2f} | "
                   f"{ln['error']:+.0%} | {ln['peak_above'] / MIB:.0f} ({ln['base'] / MIB:.0f}) | "
                   f"{p['step_s']:.3g} / {ln['step_s']:.3g} |")
    predicted, measured = orders(lines)
    pairs = ordering_agrees(lines)
    out += ["", f"Step time, fastest first: predicted {' < '.join(predicted)}; measured {' < '.join(measured)}"
            f" ({'the same order' if predicted == measured else 'not the same order'}).",
            f"Every pair the planner separates by more than 25%: {sum(ok for *_, ok in pairs)} of {len(pairs)} agree"
            + ("" if all(ok for *_, ok in pairs) else " (disagree: " + ", ".join(
                f"{f} < {s}" for f, s, ok in pairs if not ok) + ")") + "."]
    return "\n".join(out) + "\n"
