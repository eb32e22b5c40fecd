"""allreduce-plan's predictions against real runs of the project's GPT (examples/gpt.py).

    python benchmarks/plan_bench.py                    # -np 4: t1 x ZeRO 0-3, t2, t4; writes results/plan.json
    python benchmarks/plan_bench.py --render           # the BENCHMARKS.md section from results/plan.json

One launch runs every configuration in turn in the same ranks (each one's model and optimizer are
dropped before the next is built). Per configuration and rank it measures

* **counted arrays**, from the run's live objects: the weights (``model.trainable_variables``), the
  optimizer state (the Keras optimizer's variables; the inner one's for ``ShardedOptimizer``), and
  the activations: the bytes of every forward tensor that the backward pass reads, counted in the
  traced step's graph (what must stay alive from forward to backward; shapes are static);
* **peak RSS above the baseline**: ``VmHWM`` after the steps, less ``VmRSS`` just before the model
  was built (the peak is reset there through ``/proc/self/clear_refs``), all ranks with
  ``MALLOC_MMAP_THRESHOLD_=131072``; the baseline (TensorFlow's runtime, the previous
  configurations' leftovers) is printed beside it;
* **step time**: the median of the timed steps, after one traced step.

The planner's prediction for the same layout (float32 Adam, no dropout, untied head, the example's
shape) stands beside each. Gradients are not a live object after the step, so the table puts the
planner's gradient bytes in both columns and says so.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "plan.json"
MIB = float(1 << 20)
DEFAULT_CONFIGS = ("t1z0", "t1z1", "t1z2", "t1z3", "t2z0", "t4z0")
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def parse_config(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"t(\d+)z([0-3])", text)
    if m is None:
        raise ValueError(f"a configuration is t<tensor>z<ZeRO stage>, e.g. t2z0; got {text!r}")
    return int(m.group(1)), int(m.group(2))


def kept_activation_bytes(graph, loss) -> int:
    """Bytes of the forward tensors the backward pass reads in a traced training step.

    The forward pass is every op the loss's value depends on; any other op that reads one of its tensors
    (the gradients) keeps that tensor alive from forward to backward. A Reshape or Identity shares
    its input's buffer, so each is followed to the tensor that owns the memory, counted once;
    variable reads and constants are weights, not activations."""
    forward, stack = set(), [loss.op]
    while stack:
        op = stack.pop()
        if op not in forward:
            forward.add(op)
            stack += [t.op for t in op.inputs]           # data only: the step's output waits on the update too
    owners = set()
    for op in graph.get_operations():
        if op in forward:
            continue
        for t in op.inputs:
            while t.op.type in _ALIASES and t.op.inputs:
                t = t.op.inputs[0]
            if t.op in forward and t.op.type not in _NOT_ACTIVATIONS:
                owners.add(t.ref())
    tensors = [r.deref() for r in owners]
    return sum(t.shape.num_elements() * t.dtype.size for t in tensors
               if t.dtype.is_floating and t.shape.is_fully_defined())


_ALIASES = {"Reshape", "Identity", "ExpandDims", "Squeeze"}
_NOT_ACTIVATIONS = {"ReadVariableOp", "Const", "VarHandleOp", "Placeholder", "ResourceGather"}


def _matmul_rate(tf, tfops, hidden: int) -> float:
    """Flops a second of this rank, every rank multiplying at once (they share the cores, as in training):
    the median of 5 float32 matmuls of (8 hidden) x hidden x 4 hidden."""
    a, b = tf.random.normal([8 * hidden, hidden]), tf.random.normal([hidden, 4 * hidden])
    mm = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
    float(mm())
    tfops.allreduce(tf.zeros([1]), name="plan_bench.rate")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        float(mm())
        times.append(time.perf_counter() - start)
    return 2.0 * 8 * hidden * hidden * 4 * hidden / statistics.median(times)


def _train_step(tf, tfops, model, optimizer, data_set):
    """examples/gpt.py's step (no sequence parallelism), its gradients reduced as one group: with
    several, tfops.training.overlap's submit-first edges close a cycle with the split layers'
    collectives in this graph ("nodes in a cycle", found here at hidden 128; left to its owner)."""
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = model.loss_of(model(x), y)
        if data_set is not None:
            tape = tfops.DistributedGradientTape(tape, process_set=data_set, num_groups=1)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    import keras
    import tfops
    from tfops import parallel
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    tfops.init()
    ids, vocab = gpt.text_and_vocab()
    cfg = gpt.Config(args.layers, args.hidden, args.heads, args.seq, vocab)
    rate = _matmul_rate(tf, tfops, args.hidden)                      # also loads the runtime's kernels
    meshes = {}
    for name in args.configs.split(","):
        t, z = parse_config(name)
        mesh = meshes.get(t) or meshes.setdefault(t, parallel.Mesh(tensor=t))
        gc.collect()
        base = _status("VmRSS")
        _reset_peak()
        model = gpt.build(cfg, mesh)
        if z == 3:
            tfops.sharding.fully_shard(model, process_set=mesh.data_set)
        inner = keras.optimizers.Adam(1e-3)
        opt = inner if z == 0 else tfops.ShardedOptimizer(inner, stage=z, process_set=None if z == 3 else mesh.data_set)
        step = _train_step(tf, tfops, model, opt, mesh.data_set if z == 0 and mesh.data > 1 else None)
        rows = args.batch // mesh.data
        mine = slice(mesh.data_rank * rows, (mesh.data_rank + 1) * rows)
        xs = [tuple(tf.constant(a[mine]) for a in gpt.batch(ids, i, args.batch, cfg.seq)) for i in range(args.steps + 1)]
        step(*xs[0])                                                   # trace, build the optimizer
        concrete = step.get_concrete_function(*xs[0])
        graph, loss = concrete.graph, concrete.graph.outputs[0]
        times = []
        for x, y in xs[1:]:
            tfops.allreduce(tf.zeros([1]), name=f"plan_bench.barrier.{name}")
            start = time.perf_counter()
            float(step(x, y))
            times.append(time.perf_counter() - start)
        # Adam's m and v, and ShardedOptimizer's copy of this rank's slice of the weights (stages 1-2)
        state_vars = list(getattr(opt, "inner_optimizer", opt).variables) + list(getattr(opt, "_seg_vars", []))
        out = {"config": name, "rank": tfops.rank(), "np": tfops.size(), "tensor": t, "data": mesh.data, "zero": z,
               "rows": rows, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads, "seq": cfg.seq,
               "vocab": cfg.vocab, "params": sum(int(np.prod(v.shape)) for v in model.trainable_variables),
               "weights": sum(v.numpy().nbytes for v in model.trainable_variables),
               "state": sum(v.numpy().nbytes for v in state_vars if int(np.prod(v.shape)) > 1),
               "activations": kept_activation_bytes(graph, loss), "base": base,
               "peak_above": _status("VmHWM") - base, "step_s": statistics.median(times), "flops": rate}
        print("RESULT " + json.dumps(out), flush=True)
        del model, opt, inner, step, concrete, graph, loss, state_vars
        keras.backend.clear_session()


def launch(np_: int, configs: str, *, layers: int, hidden: int, heads: int, seq: int, batch: int,
           steps: int, timeout: float = 1800) -> list[dict]:
    cmd = ["allreduce-run", "-np", str(np_), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--configs", configs, "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
           "--seq", str(seq), "--batch", str(batch), "--steps", str(steps)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1", ALLREDUCE_TIMEOUT="600", **FIXED_MMAP)   # loaded machines: slow, not stuck
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # the launcher's session: mpirun and every rank
        out, err = proc.communicate()
        err += f"\ntimed out after {timeout:g} s"
    rows = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0:
        # keep what the configurations before the failure measured; say which failed and why
        print(f"{' '.join(cmd)} failed ({proc.returncode}) after {len(rows)} results:\n{err[-3000:]}",
              file=sys.stderr)
        if not rows:
            raise SystemExit(1)
    return rows


# --------------------------------------------------------------------------- the planner's side
def predict(row: dict) -> dict:
    """The planner's bytes and seconds for one measured row's layout (float32 Adam; the example's
    model: no dropout, untied head; tfops keeps the inner optimizer's copy of the slice at stages 1-2)."""
    from allreduce.plan import PRECISIONS, Layout, Machine, Transformer, memory, step_time
    fp32 = PRECISIONS["fp32"]
    model = Transformer(row["layers"], row["hidden"], row["heads"], row["seq"], row["vocab"], dropout=False,
                        tied=False, kept="keras", name="examples/gpt.py")
    lay = Layout(data=row["data"], tensor=row["tensor"], zero=row["zero"], micro_batch=row["rows"])
    mem = memory(model, lay, fp32, extra_state_sharded=4.0)
    st = step_time(model, lay, fp32, Machine(flops=row["flops"]), stage_params=mem.params)
    return {"weights": mem.weights, "grads": mem.grads, "state": mem.state, "activations": mem.activations,
            "total": mem.total, "step_s": st.total, "params": mem.params}


def compare(rows: list[dict]) -> list[dict]:
    """One line per configuration: the fullest rank's counts (max over ranks) beside the prediction."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        top = max(mine, key=lambda r: r["weights"] + r["state"] + r["activations"])
        pred = predict(top)
        counted = top["weights"] + pred["grads"] + top["state"] + top["activations"]
        out.append({"config": name, "np": top["np"], "tensor": top["tensor"], "data": top["data"],
                    "zero": top["zero"], "pred": pred, "weights": top["weights"], "state": top["state"],
                    "activations": top["activations"], "counted": counted,
                    "error": counted / pred["total"] - 1, "base": max(r["base"] for r in mine),
                    "peak_above": max(r["peak_above"] for r in mine),
                    "step_s": statistics.median(r["step_s"] for r in mine), "flops": top["flops"]})
    return out


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


def render(saved: dict) -> str:
    lines = compare(saved["rows"])
    a = saved["args"]
    out = [f"## The planner's predictions against the GPT example (issue 44)", "",
           f"{_runs(saved)}: examples/gpt.py with {a['layers']} layers, "
           f"hidden {a['hidden']}, {a['heads']} heads, sequence {a['seq']}, global batch {a['batch']}, float32 Adam, "
           f"-np {lines[0]['np'] if lines else '?'}, every configuration in the same ranks one after another. MiB per "
           "rank, the fullest rank. *Counted*: weights and optimizer state from the live variables, activations = "
           "the forward tensors the backward pass reads in the traced step (gradients: the planner's figure in both "
           "columns, they are not a live object after the step; at ZeRO 3 the predicted weights include the two "
           "gathered layers, which live only while a layer runs, and the counted ones are the shards). *Peak above base*: VmHWM less VmRSS before the "
           "model was built, MALLOC_MMAP_THRESHOLD_=131072; base = TensorFlow's runtime and what earlier "
           "configurations left. Step: median measured; predicted from the planner with the rate a matmul "
           "reached in the same run.", "",
           "| config | weights pred / counted | state pred / counted | activations pred / counted | total pred / "
           "counted | error | peak above base (base) | step s pred / measured |",
           "|---|---|---|---|---|---|---|---|"]
    for ln in lines:
        p = ln["pred"]
        out.append(f"| {ln['config']} (d{ln['data']}) | {p['weights'] / MIB:.1f} / {ln['weights'] / MIB:.1f} | "
                   f"{p['state'] / MIB:.1f} / {ln['state'] / MIB:.1f} | {p['activations'] / MIB:.1f} / "
                   f"{ln['activations'] / MIB:.1f} | {p['total'] / MIB:.1f} / {ln['counted'] / MIB:.1f} | "
                   f"{ln['error']:+.0%} | {ln['peak_above'] / MIB:.0f} ({ln['base'] / MIB:.0f}) | "
                   f"{p['step_s']:.3g} / {ln['step_s']:.3g} |")
    pairs = ordering_agrees(lines)
    out += ["", f"Step-time order, every pair the planner separates by more than 25%: "
            f"{sum(ok for *_, ok in pairs)} of {len(pairs)} agree"
            + ("" if all(ok for *_, ok in pairs) else " (disagree: " + ", ".join(
                f"{f} < {s}" for f, s, ok in pairs if not ok) + ")") + "."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("-np", "--np", dest="np_", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--render", action="store_true", help="print the section from results/plan.json")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.render:
        load = os.getloadavg()
        rows = launch(args.np_, args.configs, layers=args.layers, hidden=args.hidden, heads=args.heads,
                      seq=args.seq, batch=args.batch, steps=args.steps)
        saved = {"rows": rows, "args": vars(args), "command": "python benchmarks/plan_bench.py " + " ".join(argv or sys.argv[1:]),
                 "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "load": f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after"}
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(saved, indent=1))
    print(render(json.loads(Path(args.results).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
