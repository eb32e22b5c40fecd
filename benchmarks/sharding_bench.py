"""What ShardedOptimizer saves and costs: optimizer-state bytes, peak memory, a memory budget, step time.

::

    python benchmarks/sharding_bench.py --part state      # Adam state bytes per rank, -np 1, 2, 4
    python benchmarks/sharding_bench.py --part memory     # peak RSS per parameter, 151 M parameters, -np 2, 4
    python benchmarks/sharding_bench.py --part budget     # unsharded vs stage 2 under a per-rank RSS budget, -np 4
    python benchmarks/sharding_bench.py --part time       # step time against DistributedOptimizer, -np 2
    python benchmarks/sharding_bench.py --part cluster    # the same on the 1 Gbit/s namespace cluster, 2 x 1 (root)
    python benchmarks/sharding_bench.py --part user --label after   # issue 44's measurement, -np 2, 4
    python benchmarks/sharding_bench.py --write           # the "## Sharding" section of BENCHMARKS.md
    python benchmarks/sharding_bench.py                   # measures nothing: re-renders the recorded rows

Each part launches ``allreduce-run -np P python benchmarks/sharding_bench.py --worker ...``; the
ranks print one JSON line each, kept in benchmarks/results/sharding.json (a part re-run
replaces its rows). ``--write`` renders the saved rows into BENCHMARKS.md's own section (the
other sections are kept as they are).

state    the sum of the bytes of the wrapped optimizer's variables (``inner_optimizer.variables``:
         Adam's m and v, its iteration count and learning rate) on each rank, against a plain
         Adam over the same model; goal 1/p of it plus at most p elements per slot.
memory   ``getrusage(RUSAGE_SELF).ru_maxrss`` (every page the process ever held resident) after 3
         Adam steps in a ``tf.function`` of a 151.1 M-parameter MLP (36 layers of 2048 x 2048),
         batch 16, divided by the parameter count; unsharded is ``DistributedOptimizer``. Every
         row at -np 2 and 4 with ``MALLOC_MMAP_THRESHOLD_=131072`` (:data:`FIXED_MMAP`), and -np 4
         unsharded and stage 2 again with glibc's default. ``TF + Python`` is the RSS after
         ``import tensorflow`` and the model's construction less its weights; ``formula`` is what
         the stage's arrays need (module docstring of tfops/sharding/optimizer.py).
budget   the budget stands in for a GPU's memory: a thread polls ``VmRSS`` every 5 ms and ends
         the process (exit 3, the job fails) the moment it passes ``--budget-mib``; the peak
         ``ru_maxrss`` of a run that finished is checked against it too.
time     seconds per step of a 5.5 M-parameter MLP at -np 2, batch 32, both optimizers in one
         launch, alternating (3 rounds of 10 timed steps each after a warm-up), medians.
user     issue 44's user measurement, reproduced: ``ru_maxrss`` after 5 Adam steps in a
         ``tf.function`` less ``ru_maxrss`` once the model is built ("peak above the model"), glibc's
         default allocator, a 16.8 M-parameter MLP (4096 x 4096 plus a 10-wide head), batch 32, at
         -np 2 and 4, plain (``DistributedOptimizer``), stage 1 and stage 2. ``--label`` names the
         code measured (``before`` / ``after`` a change); each label keeps its own rows. ``now``:
         both allocators (:data:`ALLOCATORS`), ``--runs`` launches per row (default 3); under TF's
         pool each rank also records whether TF copied its batch array into the pool
         (``batch_in_pool``) and the pool's live peak over the steps (``pool_peak_mib``).
cluster  ``time`` on two namespace hosts joined by a 1 Gbit/s link, one rank each
         (``allreduce-cluster --prefix arsh up --nodes 2 --link 1gbit --slots 1``, always taken
         down); both optimizers move the same bytes, so the ratio is what sharding's own work costs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "sharding.json"
PAGE = ROOT / "BENCHMARKS.md"
TITLE = "## Sharding: optimizer state, peak memory and step time (issue 33)"
BIG = (2048, 4096, 4096, 4096, 2048)          # 50.3 M parameters
SMALL = (1024, 1536, 1536, 1024)              # 5.5 M parameters
DEEP = (2048,) * 37                           # 151.1 M parameters: 36 layers of 2048 x 2048
DEEP24 = (2048,) * 25                         # 100.7 M parameters: the largest unsharded -np 4 run this shared VM holds
USER = (4096, 4096, 10)                       # 16.8 M parameters: issue 44's "4096 x 4096 plus a head"
MODELS = {"big": BIG, "small": SMALL, "deep": DEEP, "deep24": DEEP24, "user": USER}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _watch_budget(mib: float) -> None:
    def poll():
        while True:
            with open("/proc/self/status") as f:
                rss = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024.0
            if rss > mib:
                print(json.dumps({"over_budget_mib": rss, "budget_mib": mib}), flush=True)
                os._exit(3)
            time.sleep(0.005)
    threading.Thread(target=poll, daemon=True).start()


def _pool_bytes(what: str = "current") -> int | None:
    """Bytes of TensorFlow's CPU pool (the BFC allocator oneDNN's build uses) now in use, or at
    most since the last reset (``what="peak"``); None where TF's tensors come from malloc."""
    import tensorflow as tf
    try:
        return tf.config.experimental.get_memory_info("CPU:0")[what]
    except ValueError:                                # "Allocator stats not available": no pool
        return None


def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    rss_import = _rss_mib()
    import keras
    import tfops
    tfops.init()
    if args.budget_mib:
        _watch_budget(args.budget_mib)
    widths = MODELS[args.model]
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((widths[0],))] + [keras.layers.Dense(w) for w in widths[1:]])
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rss_model = _rss_mib()
    if _pool_bytes() is not None:                     # the pool's peak from here on: the steps' own
        tf.config.experimental.reset_memory_stats("CPU:0")

    def make(mode):
        inner = keras.optimizers.Adam(1e-4)
        return tfops.DistributedOptimizer(inner) if mode == "unsharded" else tfops.ShardedOptimizer(inner, stage=int(mode[-1]))
    rng = np.random.default_rng(tfops.rank())
    pool_before = _pool_bytes()
    batch = rng.standard_normal((args.batch, widths[0])).astype("f4")
    x = tf.constant(batch)          # TF wraps the array or copies it into its pool, as its address allows
    batch_in_pool = None if pool_before is None else _pool_bytes() - pool_before >= batch.nbytes
    y = tf.constant(rng.standard_normal((args.batch, widths[-1])).astype("f4"))

    def stepper(opt):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return step
    out = {"rank": tfops.rank(), "np": tfops.size(), "params": n, "mode": args.mode}
    if args.what == "state":
        opt = make(args.mode)
        opt.build(model.trainable_variables)
        plain = keras.optimizers.Adam(1e-4)
        plain.build(model.trainable_variables)
        out.update(state_bytes=sum(v.numpy().nbytes for v in getattr(opt, "inner_optimizer", opt).variables),
                   plain_bytes=sum(v.numpy().nbytes for v in plain.variables),
                   # elements this rank holds beyond floor(N/p): 0 or 1 per dtype (nothing is padded)
                   padding=sum(sh.per_rank - sh.total // tfops.size() for sh in getattr(opt, "_shards", [])))
    elif args.what == "memory":
        step = stepper(make(args.mode))
        for _ in range(args.steps):
            step()
        out.update(rss_import_mib=rss_import, rss_model_mib=rss_model, peak_mib=_rss_mib())
        if pool_before is not None:
            out.update(batch_in_pool=batch_in_pool, pool_peak_mib=_pool_bytes("peak") / 2**20,
                       pool_model_mib=pool_before / 2**20)
        if args.budget_mib:
            out["budget_mib"] = args.budget_mib
            out["fits"] = out["peak_mib"] <= args.budget_mib
    else:
        steps = {mode: stepper(make(mode)) for mode in ("unsharded", "stage2")}
        times: dict[str, list[float]] = {mode: [] for mode in steps}
        for mode, step in steps.items():
            step()                                    # trace and warm up
        for _ in range(3):
            for mode, step in steps.items():
                tfops.allreduce(tf.zeros([1]), name="sharding_bench.barrier")
                t = time.perf_counter()
                for _ in range(10):
                    step()
                float(model.trainable_variables[0][0, 0])   # the last step has finished
                times[mode].append((time.perf_counter() - t) / 10)
        out.update({f"{m}_s": statistics.median(v) for m, v in times.items()})
    print("RESULT " + json.dumps(out), flush=True)


def launch(np_: int, *args: str, check: bool = True, cluster: str = "", env: dict | None = None) -> list[dict]:
    cmd = ["allreduce-run", *([f"--cluster={cluster}"] if cluster else []), "-np", str(np_), sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    over = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"over_budget_mib"')]
    if over:
        return [{"np": np_, "over_budget_mib": over[0]["over_budget_mib"], "budget_mib": over[0]["budget_mib"],
                 "fits": False, "args": list(args)}]
    if check and (proc.returncode != 0 or len(rows) != np_):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return rows


# --------------------------------------------------------------------------- parts
def part_state() -> list[dict]:
    rows = []
    for np_ in (1, 2, 4):
        rows += launch(np_, "state", "--mode", "stage2", "--model", "big")
    return rows


FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc's setting under which RSS follows the arrays alive: every block of 128 KiB or more is its
own mapping, handed back when freed. By default glibc raises that threshold to the size of each
large block freed (up to 32 MiB), so later blocks come from its heaps, which keep freed memory."""


def part_memory(steps: int) -> list[dict]:
    rows = []
    for np_ in (2, 4):
        for mode in ("unsharded", "stage1", "stage2"):
            got = launch(np_, "memory", "--mode", mode, "--model", "deep", "--steps", str(steps), env=FIXED_MMAP)
            rows += [dict(r, malloc="fixed") for r in got]
    for mode in ("unsharded", "stage2"):
        got = launch(4, "memory", "--mode", mode, "--model", "deep", "--steps", str(steps))
        rows += [dict(r, malloc="default") for r in got]
    return rows


#: where TensorFlow's own tensors live. "tf": TensorFlow as it comes (oneDNN on, the default on x86
#: Linux): its CPU allocator is a BFC pool ("mklcpu") that keeps every region it ever reserved, so
#: the RSS counts every page it ever handed out, and where it placed the tensors decides that
#: (benchmarks/pool_trace.py); "glibc": TF_ENABLE_ONEDNN_OPTS=0, TensorFlow's tensors from glibc's
#: malloc as it comes.
ALLOCATORS = {"tf": {}, "glibc": {"TF_ENABLE_ONEDNN_OPTS": "0"}}
USER_RUNS = 3


def part_user(label: str, runs: int = USER_RUNS) -> list[dict]:
    rows = []
    for allocator in (ALLOCATORS if label == "now" else ["tf"]):
        for np_ in (2, 4):
            for mode in ("unsharded", "stage1", "stage2"):
                for run in range(runs if label == "now" else 1):
                    got = launch(np_, "memory", "--mode", mode, "--model", "user", "--steps", "5", "--batch", "32",
                                 env=ALLOCATORS[allocator])
                    rows += [dict(r, label=label, allocator=allocator, run=run) for r in got]
    return rows


def _render_user(saved: dict) -> list[str]:
    """Issue 44's table: peak above the built model, MiB, per label, np and stage, against the formula."""
    lines = ["Peak RSS above the built model (issue 44's measurement: `ru_maxrss` after 5 Adam steps in a "
             "`tf.function` less `ru_maxrss` once the model is built; max over ranks; glibc's default allocator; "
             "16.8 M-parameter MLP, 4096 x 4096 plus a 10-wide head, batch 32). `formula`: the arrays the stage "
             "keeps beyond the weights (12N, 4N + 12N/p, 16N/p bytes). Goals (issue 44, -np 2): stage 2 at most "
             "0.75x plain, stage 1 at most plain.", "",
             "| code | np | optimizer | peak above model MiB | formula MiB | over formula MiB | vs plain | goal |",
             "|:---|---:|:---|---:|---:|---:|---:|:---|"]
    formula = {"unsharded": lambda p: 12, "stage1": lambda p: 4 + 12 / p, "stage2": lambda p: 16 / p}
    goal = {"stage1": 1.0, "stage2": 0.75}
    for label in ("before", "after"):
        rows = saved.get(f"user_{label}", {}).get("rows", [])
        for np_ in sorted({r["np"] for r in rows}):
            plain = None
            for mode in ("unsharded", "stage1", "stage2"):
                mine = [r for r in rows if r["np"] == np_ and r["mode"] == mode]
                if not mine:
                    continue
                n = mine[0]["params"]
                above = max(r["peak_mib"] - r["rss_model_mib"] for r in mine)
                plain = plain or above
                want = formula[mode](np_) * n / 2**20
                verdict = (("met" if above / plain <= goal[mode] else "NOT met") if mode in goal and np_ == 2
                           else "")
                lines.append(f"| {label} | {np_} | {mode} | {above:.0f} | {want:.0f} | {above - want:+.0f} | "
                             f"{above / plain:.2f}x | {verdict} |")
    return lines + [""] + _render_user_now(saved)


def _render_user_now(saved: dict) -> list[str]:
    """The same measure, the same code, both places TensorFlow's tensors can live, each (np, mode)
    launched USER_RUNS times: the worst run (max over ranks and runs) decides, the runs beside it."""
    rows = saved.get("user_now", {}).get("rows", [])
    if not rows:
        return []
    formula = {"unsharded": lambda p: 12, "stage1": lambda p: 4 + 12 / p, "stage2": lambda p: 16 / p}
    goal = {"stage1": 1.0, "stage2": 0.75}
    n_runs = len({r["run"] for r in rows})
    lines = [f"The same measure on the current code (`--label now`), each row launched {n_runs} times, for both "
             "places TensorFlow's own tensors can live. `tf`: TensorFlow as it comes; with oneDNN on (the default on "
             "x86 Linux) its CPU allocator is a BFC pool (`mklcpu`) that never gives a region back, so RSS counts "
             "every page the pool ever handed out, and where it placed each tensor decides how many those are "
             "(below). `glibc`: `TF_ENABLE_ONEDNN_OPTS=0`, TensorFlow's tensors from glibc's malloc as it comes (no "
             "`MALLOC_*` setting). `worst`: max over ranks and runs (the goal is read on it); `runs`: each run's max "
             "over ranks.", "",
             "| allocator | np | optimizer | worst MiB | runs MiB | formula MiB | worst vs plain's worst | goal |",
             "|:---|---:|:---|---:|:---|---:|---:|:---|"]
    for allocator in ALLOCATORS:
        for np_ in sorted({r["np"] for r in rows}):
            plain = None
            for mode in ("unsharded", "stage1", "stage2"):
                mine = [r for r in rows if r["np"] == np_ and r["mode"] == mode and r.get("allocator") == allocator]
                if not mine:
                    continue
                runs = [max(r["peak_mib"] - r["rss_model_mib"] for r in mine if r["run"] == k)
                        for k in sorted({r["run"] for r in mine})]
                worst = max(runs)
                plain = plain or worst
                want = formula[mode](np_) * mine[0]["params"] / 2**20
                verdict = (("met" if worst / plain <= goal[mode] else "NOT met") if mode in goal and np_ == 2 else "")
                lines.append(f"| {allocator} | {np_} | {mode} | {worst:.0f} | {', '.join(f'{x:.0f}' for x in runs)} | "
                             f"{want:.0f} | {worst / plain:.2f}x | {verdict} |")
    return lines + [""] + _render_pool(rows) + _render_trace(saved.get("pool_trace"))


def _render_trace(trace: dict | None) -> list[str]:
    """benchmarks/pool_trace.py's lines, as it saved them (``--save``)."""
    if not trace:
        return []
    return [f"Where the pool put them, rank by rank (`{trace['command']}`, listed above; the pool's own log, "
            "`TF_CPP_VMODULE=bfc_allocator=3,executor=1`: the regions it reserved, the MiB it ever handed out, and "
            "each block of 1 MiB or more that brought pages never handed out before, with the op that asked, "
            "`eager` outside a step's ops):", "", "```", *trace["lines"], "```", ""]


def _live(row: dict) -> float:
    return row["pool_peak_mib"]


def _render_pool(rows: list[dict]) -> list[str]:
    """Under TF's pool, -np 2: how many launches of each stage met its goal, and what set the
    peak: whether TF copied the batch array into its pool (``batch_in_pool``) before the first
    step, against the pool's live peak over the steps (``pool_peak_mib``, TF's own count)."""
    tf_rows = [r for r in rows if r.get("allocator") == "tf" and r["np"] == 2 and "batch_in_pool" in r]
    plain = [r["peak_mib"] - r["rss_model_mib"] for r in tf_rows if r["mode"] == "unsharded"]
    if not plain:
        return []
    lines = []
    for mode, goal in (("stage1", 1.0), ("stage2", 0.75)):
        mine = [r for r in tf_rows if r["mode"] == mode]
        launches = [[r for r in mine if r["run"] == k] for k in sorted({r["run"] for r in mine})]
        met = sum(max(r["peak_mib"] - r["rss_model_mib"] for r in ranks) <= goal * max(plain) for ranks in launches)

        def spread(rs, key=lambda r: r["peak_mib"] - r["rss_model_mib"]):
            return f"{min(map(key, rs)):.0f}-{max(map(key, rs)):.0f} MiB" if rs else "none"
        copied = [r for r in mine if r["batch_in_pool"]]
        wrapped = [r for r in mine if not r["batch_in_pool"]]
        lines.append(f"- `tf`, -np 2, {mode}: **{met} of {len(launches)}** launches within {goal:.2f}x of plain's worst "
                     f"({max(plain):.0f} MiB). Per rank: batch array copied into TF's pool {len(copied)} times, "
                     f"{spread(copied)} above the model (the pool's live peak {spread(copied, _live)}); wrapped "
                     f"without a copy {len(wrapped)} times, {spread(wrapped)} (live peak {spread(wrapped, _live)}).")
    lo, hi = (f(r["pool_peak_mib"] for r in tf_rows if r["mode"] == "unsharded") for f in (min, max))
    return ["Under TensorFlow's pool (`tf`), what decides a rank's peak (fields `batch_in_pool` and `pool_peak_mib` "
            "of benchmarks/results/sharding.json; the live peak counts the pool's bytes in use over the optimizer's "
            f"build and the steps, the model's weights included; plain's: {lo:.0f}"
            + (f"-{hi:.0f}" if round(hi) != round(lo) else "") + " MiB):", ""] + lines + [""]


def part_budget(budget: float, steps: int) -> list[dict]:
    rows = []
    for mode in ("unsharded", "stage2"):
        got = launch(4, "memory", "--mode", mode, "--model", "big", "--steps", str(steps), "--budget-mib", str(budget))
        rows += [dict(r, mode=mode, budget_mib=budget) for r in got]
    return rows


def part_time() -> list[dict]:
    return launch(2, "time", "--model", "small", "--batch", "32")


def part_cluster() -> list[dict]:
    from allreduce.cluster import net
    if os.geteuid() != 0:
        raise SystemExit("sharding_bench --part cluster: the namespace cluster needs root")
    up = ["allreduce-cluster", "--prefix", "arsh", "up", "--nodes", "2", "--link", "1gbit", "--slots", "1"]
    try:
        subprocess.run(up, check=True, timeout=300)
        return launch(2, "time", "--model", "small", "--batch", "32", cluster="arsh")
    finally:
        net.down("arsh")


# --------------------------------------------------------------------------- the page
def _median(rows, key):
    return statistics.median(r[key] for r in rows)


def _step_time(rows, what: str, goal: float) -> str:
    a, b = _median(rows, "unsharded_s"), _median(rows, "stage2_s")
    return (f"{what}: DistributedOptimizer {a * 1e3:.1f} ms, ShardedOptimizer stage 2 {b * 1e3:.1f} ms: "
            f"**{b / a:.2f}x** (goal <= {goal:.2f}x: {'met' if b / a <= goal else 'NOT met'}).")


def render(saved: dict) -> str:
    lines = [TITLE, ""]
    for part, info in saved.items():
        lines.append(f"`{info['command']}` at {info['when']} (load {info['load']}){info.get('note', '')}.")
    lines.append("")
    if "state" in saved:
        rows = saved["state"]["rows"]
        lines += ["Optimizer-state bytes per rank (Adam over the 50.3 M-parameter MLP; `inner_optimizer.variables`, "
                  "iteration and learning rate included). Goal: 1/p of unsharded + at most p elements per slot.", "",
                  "| np | unsharded bytes | sharded bytes (max over ranks) | ratio | 1/p | elements over N/p (max) | goal |",
                  "|---:|---:|---:|---:|---:|---:|:---|"]
        for np_ in sorted({r["np"] for r in rows}):
            mine = [r for r in rows if r["np"] == np_]
            plain, worst = mine[0]["plain_bytes"], max(r["state_bytes"] for r in mine)
            bound = plain / np_ + 2 * 4 * np_ + 12
            lines.append(f"| {np_} | {plain:,} | {worst:,} | {worst / plain:.4f} | {1 / np_:.4f} | "
                         f"{max(r['padding'] for r in mine)} | {'met' if worst <= bound else 'NOT met'} |")
        lines.append("")
    if "memory" in saved:
        rows = saved["memory"]["rows"]
        n = rows[0]["params"]
        lines += [f"Peak RSS per rank (`ru_maxrss`, max over ranks) per parameter, {saved['memory'].get('steps', 3)} "
                  f"Adam steps in a `tf.function`, {n / 1e6:.1f} M parameters (36 layers of 2048 x 2048). "
                  "`TF + Python`: RSS before the model's weights existed. `arrays`: peak less that, per parameter; "
                  "`formula`: what the stage's arrays need (4 weights + 4 gradients + 8 Adam slots, + 4 for the "
                  "inner optimizer's copy of the slice, sharded as the stage says: 16, 8 + 12/p, 4 + 16/p). "
                  "`malloc`: `fixed` runs every rank with `MALLOC_MMAP_THRESHOLD_=131072`, under which glibc hands "
                  "freed blocks of 128 KiB or more back at once, so RSS follows the arrays alive, as a GPU "
                  "allocator's peak does; `default` is glibc as it comes, whose heaps keep blocks freed after its "
                  "threshold has grown.", "",
                  "| malloc | np | optimizer | peak MiB | bytes/param | TF + Python MiB | arrays bytes/param | formula | "
                  "peak vs unsharded | arrays vs unsharded |", "|:---|---:|:---|---:|---:|---:|---:|---:|---:|---:|"]
        formula = {"unsharded": lambda p: 16, "stage1": lambda p: 8 + 12 / p, "stage2": lambda p: 4 + 16 / p}
        ratio = {}
        for malloc in ("fixed", "default"):
            for np_ in sorted({r["np"] for r in rows}):
                base = base_arrays = None
                for mode in ("unsharded", "stage1", "stage2"):
                    mine = [r for r in rows if r["np"] == np_ and r["mode"] == mode and r.get("malloc") == malloc]
                    if not mine:
                        continue
                    peak = max(r["peak_mib"] for r in mine)
                    tf_mib = max(r["rss_model_mib"] - 4 * n / 2**20 for r in mine)
                    base, base_arrays = base or peak, base_arrays or (peak - tf_mib)
                    lines.append(f"| {malloc} | {np_} | {mode} | {peak:.0f} | {peak * 2**20 / n:.1f} | {tf_mib:.0f} | "
                                 f"{(peak - tf_mib) * 2**20 / n:.1f} | {formula[mode](np_):.1f} | {peak / base:.2f}x | "
                                 f"{(peak - tf_mib) / base_arrays:.2f}x |")
                    ratio[(malloc, np_, mode)] = (peak / base, (peak - tf_mib) / base_arrays)
        lines.append("")
        fixed, default = ratio.get(("fixed", 4, "stage2")), ratio.get(("default", 4, "stage2"))
        if fixed:
            lines.append(f"Goal at -np 4, stage 2: peak <= 0.6x unsharded. With `fixed`: **{fixed[0]:.2f}x** "
                         f"({'met' if fixed[0] <= 0.6 else 'NOT met'}; the arrays alone {fixed[1]:.2f}x)"
                         + (f"; with glibc's default: {default[0]:.2f}x ({'met' if default[0] <= 0.6 else 'NOT met'}; "
                            f"the arrays alone {default[1]:.2f}x): the default heaps keep what stage 2 frees."
                            if default else "."))
            lines.append("")
    if "user_before" in saved or "user_after" in saved or "user_now" in saved:
        lines += _render_user(saved)
    if "budget" in saved:
        rows = saved["budget"]["rows"]
        lines += [f"A per-rank budget of {rows[0]['budget_mib']:.0f} MiB at -np 4, the 50.3 M-parameter MLP, glibc's "
                  "default malloc (a thread ends the process the moment VmRSS passes it; a finished run's "
                  "`ru_maxrss` is checked too):", ""]
        for mode in ("unsharded", "stage2"):
            mine = [r for r in rows if r.get("mode") == mode]
            if any("over_budget_mib" in r for r in mine):
                lines.append(f"- {mode}: does not fit: ended at {mine[0]['over_budget_mib']:.0f} MiB")
            else:
                lines.append(f"- {mode}: trains; peak {max(r['peak_mib'] for r in mine):.0f} MiB "
                             f"({'within' if all(r['fits'] for r in mine) else 'OVER'} the budget)")
        lines.append("")
    if "time" in saved:
        rows = saved["time"]["rows"]
        lines += [_step_time(rows, f"Step time, -np 2 on this machine, {rows[0]['params']:,} parameters, "
                                   "batch 32 per rank", 1.10), ""]
    if "cluster" in saved:
        lines += [_step_time(saved["cluster"]["rows"], "Step time on the 1 Gbit/s namespace cluster, 2 hosts x 1 "
                                                       "rank, the same model and batch", 1.05), ""]
    else:
        lines += ["Step time on the 1 Gbit/s namespace cluster (goal <= 1.05x): not measured yet "
                  "(`--part cluster`).", ""]
    return "\n".join(lines)


def write_page(saved: dict) -> None:
    page = PAGE.read_text() if PAGE.is_file() else ""
    section = render(saved).rstrip() + "\n"
    parts = re.split(r"^(?=## )", page, flags=re.M)
    at = next((i for i, part in enumerate(parts) if part.startswith(TITLE)), None)
    if at is None:                                    # a new section goes last; an old one stays where it is
        PAGE.write_text(page.rstrip() + "\n\n" + section)
    else:
        parts[at] = section + ("\n" if at < len(parts) - 1 else "")
        PAGE.write_text("".join(parts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("what", nargs="?", default="memory", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="stage2", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="big", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--part", action="append", choices=["state", "memory", "budget", "time", "cluster", "user"])
    parser.add_argument("--label", default="after", choices=["before", "after", "now"],
                        help="user part: the code measured (now: both allocators, 3 runs each)")
    parser.add_argument("--runs", type=int, default=USER_RUNS, help="user part, --label now: launches per row")
    parser.add_argument("--steps", type=int, default=3, help="Adam steps per memory run")
    parser.add_argument("--budget-mib", type=float, default=0.0, help="per-rank RSS budget (budget part: 2000)")
    parser.add_argument("--write", action="store_true", help="render the saved results into BENCHMARKS.md")
    parser.add_argument("--note", default="", help="said after the command line of the parts run now")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    for part in args.part or []:
        load = os.getloadavg()
        started = time.strftime("%H:%M UTC", time.gmtime())
        rows = {"state": part_state, "time": part_time, "cluster": part_cluster, "user": lambda: part_user(args.label, args.runs),
                "memory": lambda: part_memory(args.steps),
                "budget": lambda: part_budget(args.budget_mib or 2000.0, args.steps)}[part]()
        key = f"user_{args.label}" if part == "user" else part
        saved[key] = {"rows": rows, **({"steps": args.steps} if part == "memory" else {}), "command": f"python benchmarks/sharding_bench.py --part {part}"
                       + (f" --budget-mib {args.budget_mib:g}" if part == "budget" and args.budget_mib else "")
                       + (f" --label {args.label}" if part == "user" else "")
                       + (f" --runs {args.runs}" if part == "user" and args.runs != USER_RUNS else ""),
                       "when": started, "load": f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
                       "note": f"; {args.note}" if args.note else ""}
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(saved, indent=1))
    if not args.part:               # nothing measured now: say so, before the recorded commands and times
        print(f"# nothing measured: this re-renders the recorded run in {RESULTS.relative_to(ROOT)} (each "
              "part's command and when it ran are below; measure again with --part NAME)")
    print(render(saved))
    if args.write:
        write_page(saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
