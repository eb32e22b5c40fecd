"""allreduce-plan's predictions against real runs of the project's GPT (examples/gpt.py).

    python benchmarks/plan_bench.py                    # -np 4: t1 x ZeRO 0-3, t2, t4, pipeline 2; writes results/plan.json
    python benchmarks/plan_bench.py --render           # the BENCHMARKS.md section from results/plan.json

A configuration is ``t<tensor>[p<pipeline>]z<ZeRO stage>``: t1z3 is fully_shard with stage 3 over
the 4 ranks, t2z0 tensor 2 x data 2, t1p2z0 pipeline 2 x data 2 (examples/gpt_pipeline.py, 1F1B).

One launch runs every configuration in turn in the same ranks (each one's model and optimizer are
dropped before the next is built). Per configuration and rank it measures

* **counted arrays**, from the run's live objects: the weights (``model.trainable_variables``), the
  optimizer state (the Keras optimizer's variables; the inner one's for ``ShardedOptimizer``), and
  the activations: the bytes of every forward tensor that the backward pass reads, counted in the
  traced step's graph (what must stay alive from forward to backward; shapes are static;
  benchmarks/plan_counts.py). Stage 3 also keeps, while a unit's backward runs, what its
  recompute keeps (counted in the same graph); a pipeline rank holds its chunk's count for one
  micro-batch (a ``tf.function`` of the chunk's forward and backward) once per micro-batch in
  flight (``Pipeline.peak_live``: its eager tapes alive at once);
* **peak RSS above the baseline**: ``VmHWM`` after the steps, less ``VmRSS`` just before the model
  was built (the peak is reset there through ``/proc/self/clear_refs``), all ranks with
  ``MALLOC_MMAP_THRESHOLD_=131072``; the baseline (TensorFlow's runtime, the previous
  configurations' leftovers) is printed beside it;
* **step time**: the median of the timed steps, after one traced step;
* **stage 3's units**: how many ``fully_shard`` made (the planner prices stage 3's collectives,
  hand-offs and exits per unit, counted from the model's shape: the two must agree).

Before the configurations, every rank at once: the matmul rate, the alpha and beta of the two
paths of collectives one allreduce per compiled call, the direct path's again with many
allreduces in a row in one call (``_in_step``: as the split layers issue them), and the host's
fixed costs (``_host_costs``).

The planner's prediction for the same layout (float32 Adam, no dropout, untied head, the example's
shape) stands beside each. Gradients are not a live object after the step, so the table puts the
planner's gradient bytes in both columns and says so.
"""
from __future__ import annotations

import argparse
import concurrent.futures
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

from plan_counts import SEED, kept_activation_bytes, rebuilt_activation_bytes
from plan_section import IN_STEP, MICRO_BATCHES, compare, predict, render  # noqa: F401 (the tests read them here)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "plan.json"
DEFAULT_CONFIGS = ("t1z0", "t1z1", "t1z2", "t1z3", "t2z0", "t4z0", "t1p2z0")
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def parse_config(text: str) -> tuple[int, int, int]:
    """``t<tensor>[p<pipeline>]z<ZeRO stage>`` -> (tensor, pipeline, stage): t2z0, t1p2z0."""
    m = re.fullmatch(r"t(\d+)(?:p(\d+))?z([0-3])", text)
    if m is None:
        raise ValueError(f"a configuration is t<tensor>[p<pipeline>]z<ZeRO stage>, e.g. t2z0 or t1p2z0; got {text!r}")
    t, p, z = int(m.group(1)), int(m.group(2) or 1), int(m.group(3))
    if p > 1 and z:
        raise ValueError(f"{text}: a pipeline runs without ZeRO here (tfops.parallel.Pipeline takes a plain optimizer)")
    return t, p, z


def _median_seconds(fn, runs: int, per: int = 1) -> float:
    """The median over ``runs`` calls of ``fn``'s wall seconds, divided by ``per`` (calls inside ``fn``)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / per)
    return statistics.median(times)


def _matmul_rate(tf, tfops, hidden: int) -> float:
    """Flops a second of this rank, every rank multiplying at once (they share the cores, as in training):
    the median of 5 float32 matmuls of (8 hidden) x hidden x 4 hidden."""
    a, b = tf.random.normal([8 * hidden, hidden]), tf.random.normal([hidden, 4 * hidden])
    mm = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
    float(mm())
    tfops.allreduce(tf.zeros([1]), name="plan_bench.rate")
    return 2.0 * 8 * hidden * hidden * 4 * hidden / _median_seconds(lambda: float(mm()), 5)


def _link(tf, op_of, p: int) -> tuple[float, float]:
    """(alpha, beta) of one path of collectives, every rank at once: the ring's terms fitted to the
    median of 5 allreduces of 4 bytes and of 4 MiB inside a tf.function, as select.py's fit reads its
    table. ``op_of(x)``: the allreduce of ``x`` by that path."""
    if p == 1:
        return 0.0, 0.0
    times = {}
    for n in (1, 1 << 20):
        x = tf.zeros([n])
        op = tf.function(lambda x=x: op_of(x))
        op()
        times[n] = _median_seconds(lambda: op().numpy(), 5)
    alpha = times[1] / (2 * (p - 1))                                   # ring: 2(p-1) messages
    beta = max(0.0, times[1 << 20] - times[1]) / (2 * (p - 1) / p * 4 * (1 << 20))
    return alpha, beta


def _in_step(tf, op_of, p: int, elements: int) -> tuple[float, float]:
    """(alpha, beta) of one path's allreduce inside a compiled step, every rank at once. A step's
    tensor-parallel allreduces follow one another inside one compiled call (f, g, f, g, ...), so
    none of them pays the call's entry and return, or the first collective's wait for the last
    rank to arrive, which ``_link`` times with each allreduce. Per size (4 bytes, and ``elements``
    float32s: a split layer's activation) the median of 7 calls of a tf.function that runs k
    allreduces in a row, each on the last one's output, for k = 4 and 20 (``IN_STEP``): (T20 - T4) / 16
    is one message's cost with none of the call's. The ring's terms fitted to the two sizes, as ``_link``."""
    if p == 1:
        return 0.0, 0.0
    per = {}
    for n in (1, elements):
        x = tf.zeros([n])
        took = {}
        for k in IN_STEP:
            @tf.function
            def chain(x=x, k=k):
                for _ in range(k):
                    x = op_of(x)
                return x
            chain()
            took[k] = _median_seconds(lambda: chain().numpy(), 7)
        per[n] = max(0.0, took[IN_STEP[1]] - took[IN_STEP[0]]) / (IN_STEP[1] - IN_STEP[0])
    alpha = per[1] / (2 * (p - 1))
    beta = max(0.0, per[elements] - per[1]) / (2 * (p - 1) / p * 4 * elements)
    return alpha, beta


def _links(tf, tfops, parallel, elements: int) -> dict:
    """The run's two paths: the engine's (tfops.allreduce: DistributedGradientTape's gradients) and a
    tensor region's direct call (the split layers; stage 3's units and the pipeline's sends call
    the communicator directly too), each timed one allreduce per compiled call; and the direct
    path again as the split layers issue it, many in a row inside one call (``_in_step``, at
    ``elements``, the largest split layer's activation)."""
    from tfops.parallel import regions
    p = tfops.size()
    mesh = parallel.Mesh(tensor=p)
    direct = lambda x: regions.allreduce_sum(x, mesh, "plan_bench link")       # noqa: E731
    alpha, beta = _link(tf, lambda x: tfops.allreduce(x, name=f"plan_bench.link.{x.shape[0]}"), p)
    alpha_d, beta_d = _link(tf, direct, p)
    alpha_s, beta_s = _in_step(tf, direct, p, elements)
    return {"alpha": alpha, "beta": beta, "alpha_direct": alpha_d, "beta_direct": beta_d,
            "alpha_in_step": alpha_s, "beta_in_step": beta_s}


def _host_costs(tf, keras) -> dict:
    """The host's fixed costs on this rank, every rank at once (allreduce/plan/time.py's c, e, u,
    x, h): the median of 5 runs each of 20 calls of a compiled function that adds 1 to one number,
    of 100 eager adds of one-element tensors, of an eager Adam step over 16 one-element weights
    (per weight), and of one compiled call of 20 ``numpy_function`` ops in a chain, each returning
    its input (per op, less a twentieth of the call: an exit) or handing it to a worker thread and
    waiting for it back, as stage 3's unit collectives are handed over (per op, less an exit)."""
    one = tf.ones([1])
    add = tf.function(lambda x: x + 1.0)
    add(one)
    weights = [keras.Variable(tf.zeros([1])) for _ in range(16)]
    grads = [tf.ones([1]) for _ in weights]
    adam = keras.optimizers.Adam(1e-3)
    adam.apply_gradients(zip(grads, weights))
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plan-bench-handoff")
    exits, handoffs = _chain(tf, lambda a: a), _chain(tf, lambda a: worker.submit(lambda: a).result())
    exits(one), handoffs(one)

    def per(fn, n: int) -> float:
        return _median_seconds(fn, 5, n)
    call = per(lambda: [add(one) for _ in range(20)], 20)
    exit_s = per(lambda: exits(one), CHAIN)
    handoff = per(lambda: handoffs(one), CHAIN)
    worker.shutdown()
    return {"call_s": call, "eager_op_s": per(lambda: [one + one for _ in range(100)], 100),
            "eager_update_s": per(lambda: adam.apply_gradients(zip(grads, weights)), len(weights)),
            "graph_exit_s": max(0.0, exit_s - call / CHAIN), "handoff_s": max(0.0, handoff - exit_s)}


CHAIN = 20      #: numpy_function ops in one compiled call, for the exit and hand-off costs


def _chain(tf, fn):
    """A compiled function of ``CHAIN`` ``numpy_function`` ops of ``fn``, each fed the last's output."""
    @tf.function
    def run(x):
        for _ in range(CHAIN):
            x = tf.numpy_function(fn, [x], tf.float32, stateful=True)
        return x
    return run


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
        seed = tf.ones_like(loss, name=SEED)                 # named: rebuilt_activation_bytes finds the flow
        grads = tape.gradient(loss, model.trainable_variables, output_gradients=seed)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def _gathered_bytes(tfops, model) -> int:
    """Stage 3: the most whole-weight bytes two consecutive units hold at once (running + prefetched)."""
    import numpy as np
    from tfops.sharding.fully_shard import state_of
    units = state_of(model).units
    whole = [sum(np.dtype(v.dtype).itemsize * int(np.prod(v.shape)) for v in u.full_vars) for u in units]
    return max((a + b for a, b in zip(whole, whole[1:])), default=sum(whole))


def _pipeline_probe(tf, pipe, rows: int, seq: int, hidden: int):
    """This rank's chunk, forward and backward of one micro-batch as a ``tf.function``: the graph
    whose kept tensors an eager tape of the pipeline holds per micro-batch in flight (its input
    and output included: Pipeline keeps both until the micro-batch's backward)."""
    chunk, k = pipe.chunks[0], pipe._k(0)
    b = rows // pipe.m
    inp = tf.zeros([b, seq], tf.int32) if k == 0 else tf.zeros([b, seq, hidden])

    @tf.function
    def probe(inp, y):
        with tf.GradientTape() as tape:
            if k > 0:
                tape.watch(inp)
            out = chunk(inp, training=True)
            if k == pipe.last:
                out = tf.reduce_mean(tf.cast(pipe.loss(y, out), tf.float32)) / pipe.m
        seed = tf.ones_like(out, name=SEED)                  # the received gradient
        return [out] + tape.gradient(out, chunk.trainable_variables + ([inp] if k > 0 else []),
                                     output_gradients=seed)
    concrete = probe.get_concrete_function(inp, tf.zeros([b, seq], tf.int32))
    return concrete.graph, concrete.graph.outputs[0]


def _run_one(name, args, tf, tfops, keras, parallel, gpt, ids, vocab, meshes) -> dict:
    """Build, trace, time and count one configuration; returns this rank's row."""
    import numpy as np
    t, p, z = parse_config(name)
    cfg = gpt.Config(args.layers, args.hidden, args.heads, args.seq, vocab)
    mesh = meshes.get((t, p)) or meshes.setdefault((t, p), parallel.Mesh(tensor=t, pipeline=p))
    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    model = gpt.build(cfg, mesh)
    inner = keras.optimizers.Adam(1e-3)
    rows = args.batch // mesh.data
    mine = slice(mesh.data_rank * rows, (mesh.data_rank + 1) * rows)
    xs = [tuple(tf.constant(a[mine]) for a in gpt.batch(ids, i, args.batch, cfg.seq)) for i in range(args.steps + 1)]
    extra = {}
    if p > 1:
        from gpt_pipeline import pipeline_of
        pipe = pipeline_of(model, mesh, micro_batches=args.micro_batches)
        opt, variables = inner, pipe.trainable_variables
        step = lambda x, y: pipe.train_step(x, y, inner)          # noqa: E731
    else:
        if z == 3:
            tfops.sharding.fully_shard(model, process_set=mesh.data_set)
        opt = inner if z == 0 else tfops.ShardedOptimizer(inner, stage=z, process_set=None if z == 3 else mesh.data_set)
        step = _train_step(tf, tfops, model, opt, mesh.data_set if z == 0 and mesh.data > 1 else None)
        variables = model.trainable_variables
    step(*xs[0])                                                   # trace, build the optimizer
    if p > 1:
        graph, loss = _pipeline_probe(tf, pipe, rows, cfg.seq, cfg.hidden)
        extra = {"pipeline_rank": mesh.pipeline_rank, "micro_batches": pipe.m, "in_flight": pipe.peak_live}
    else:
        concrete = step.get_concrete_function(*xs[0])
        graph, loss = concrete.graph, concrete.graph.outputs[0]
    if z == 3:
        from tfops.sharding.fully_shard import state_of
        extra["gathered"], extra["units"] = _gathered_bytes(tfops, model), len(state_of(model).units)
    kept, rebuilt = kept_activation_bytes(graph, loss), rebuilt_activation_bytes(graph, loss)
    times = []
    for x, y in xs[1:]:
        tfops.allreduce(tf.zeros([1]), name=f"plan_bench.barrier.{name}")
        start = time.perf_counter()
        float(step(x, y))
        times.append(time.perf_counter() - start)
    # Adam's m and v, and ShardedOptimizer's copy of this rank's slice of the weights (stages 1-2)
    state_vars = list(getattr(opt, "inner_optimizer", opt).variables) + list(getattr(opt, "_seg_vars", []))
    acts = kept * extra.get("in_flight", 1) + rebuilt
    return {"config": name, "rank": tfops.rank(), "np": tfops.size(), "tensor": t, "pipeline": p, "data": mesh.data,
            "zero": z, "rows": rows, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads, "seq": cfg.seq,
            "vocab": cfg.vocab, "params": sum(int(np.prod(v.shape)) for v in variables),
            "weights": sum(v.numpy().nbytes for v in variables),
            "state": sum(v.numpy().nbytes for v in state_vars if int(np.prod(v.shape)) > 1),
            "activations": acts, "kept": kept, "rebuilt": rebuilt, "base": base,
            "peak_above": _status("VmHWM") - base, "step_s": statistics.median(times), **extra}


def worker(args) -> None:
    import tensorflow as tf
    import keras
    import tfops
    from tfops import parallel
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    tfops.init()
    ids, vocab = gpt.text_and_vocab()
    rate = _matmul_rate(tf, tfops, args.hidden)                      # also loads the runtime's kernels
    links = _links(tf, tfops, parallel, args.seq * args.batch * args.hidden)   # tensor np's activation (d 1)
    host = _host_costs(tf, keras)
    meshes = {}
    for name in args.configs.split(","):
        out = _run_one(name, args, tf, tfops, keras, parallel, gpt, ids, vocab, meshes)
        print("RESULT " + json.dumps({**out, "flops": rate, **links, **host}), flush=True)
        keras.backend.clear_session()


def launch(np_: int, configs: str, *, layers: int, hidden: int, heads: int, seq: int, batch: int,
           steps: int, micro_batches: int = MICRO_BATCHES, timeout: float = 1800) -> list[dict]:
    cmd = ["allreduce-run", "-np", str(np_), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--configs", configs, "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
           "--seq", str(seq), "--batch", str(batch), "--steps", str(steps), "--micro-batches", str(micro_batches)]
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
    ap.add_argument("--micro-batches", type=int, default=MICRO_BATCHES, help="pipeline configurations' m")
    ap.add_argument("--render", action="store_true", help="print the section from results/plan.json")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.render:
        load = os.getloadavg()
        rows = launch(args.np_, args.configs, layers=args.layers, hidden=args.hidden, heads=args.heads,
                      seq=args.seq, batch=args.batch, steps=args.steps, micro_batches=args.micro_batches)
        saved = {"rows": rows, "args": vars(args), "command": "python benchmarks/plan_bench.py " + " ".join(argv or sys.argv[1:]),
                 "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "load": f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after"}
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(saved, indent=1))
    print(render(json.loads(Path(args.results).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
