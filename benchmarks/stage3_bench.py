"""What ZeRO stage 3 (``tfops.fully_shard`` + ``ShardedOptimizer(stage=3)``) costs: peak memory, a
memory budget, and step time against stage 2, with the prefetch's overlap read off the timeline.

    python benchmarks/stage3_bench.py --part memory    # peak RSS, 151 M parameters, -np 4 (fixed and default malloc)
    python benchmarks/stage3_bench.py --part budget --budget-mib 1650 --model big --modes unsharded,stage3-lazy
    python benchmarks/stage3_bench.py --part time      # step time, stage 3 vs stage 2, -np 2, 5.5 M parameters

memory  ``ru_maxrss`` per rank after 3 Adam steps in a ``tf.function``, max over ranks (and once
        the model is built and wrapped, before any step: "peak once wrapped"), as
        benchmarks/sharding_bench.py's memory part measures it (TensorFlow's runtime included,
        the model built whole first, as a user builds it, then sharded), for each optimizer
        given (``--modes``). ``fixed``: every rank with ``MALLOC_MMAP_THRESHOLD_=131072``;
        ``default``: glibc as it comes.
budget  every rank is killed (exit 3) the moment its RSS passes ``--budget-mib``: plain
        training and stage 3, same model.
time    median of 3 x 10 steps, stage 2, stage 3 and stage 3 without prefetch, models built
        alike in one process and stepped in turn; the timeline of stage 3's last step gives the
        fraction of each forward gather (units 1..L-1) that ran while the unit before computed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharding_bench import FIXED_MMAP, MODELS, _rss_mib, _watch_budget  # noqa: E402


def _model(widths):
    import keras
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((widths[0],))] + [keras.layers.Dense(w) for w in widths[1:]])


def _stepper(model, opt, x, y):
    import tensorflow as tf

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step


def _setup(mode, widths):
    """(model, optimizer) for ``mode``: unsharded, stage2, stage3, stage3-noprefetch, or stage3-lazy
    (the Sequential built layer by layer inside ``fully_shard(input_shape=)``: never whole)."""
    import keras
    import tfops
    from tfops.sharding.fully_shard import fully_shard
    from tfops.sharding.stage3 import FullyShardedOptimizer
    inner = keras.optimizers.Adam(1e-4)
    if mode == "stage3-lazy":
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.layers.Dense(w) for w in widths[1:]])
        return fully_shard(model, input_shape=(None, widths[0])), FullyShardedOptimizer(inner)
    model = _model(widths)
    if mode == "unsharded":
        return model, tfops.DistributedOptimizer(inner)
    if mode == "stage2":
        return model, tfops.ShardedOptimizer(inner, stage=2)
    fully_shard(model, prefetch=mode == "stage3")
    return model, FullyShardedOptimizer(inner)


def _overlap(timeline, units: int) -> float:
    """Of the last step's forward gathers of units 1..L-1, the fraction of their time that ran
    while the unit before them computed (forward)."""
    last = timeline[-(5 * units):]
    fwd = {e["unit"]: e for e in last if e["what"] == "forward"}
    total = hidden = 0.0
    for e in last:
        if e["what"] == "gather" and e["phase"] == "forward" and e["unit"] - 1 in fwd:
            f = fwd[e["unit"] - 1]
            total += e["end"] - e["start"]
            hidden += max(0.0, min(e["end"], f["end"]) - max(e["start"], f["start"]))
    return hidden / total if total else 0.0


def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    rss_import = _rss_mib()
    import tfops
    tfops.init()
    if args.budget_mib:
        _watch_budget(args.budget_mib)
    widths = MODELS[args.model]
    rng = np.random.default_rng(tfops.rank())
    x = tf.constant(rng.standard_normal((args.batch, widths[0])).astype("f4"))
    y = tf.constant(rng.standard_normal((args.batch, widths[-1])).astype("f4"))
    out = {"rank": tfops.rank(), "np": tfops.size(), "mode": args.mode, "model": args.model}
    if args.what == "memory":
        model, opt = _setup(args.mode, widths)
        out.update(params=sum(int(np.prod(v.shape)) for v in opt_model_weights(model)), rss_model_mib=_rss_mib())
        step = _stepper(model, opt, x, y)
        for _ in range(args.steps):
            step()
        out.update(rss_import_mib=rss_import, peak_mib=_rss_mib())
        if args.budget_mib:
            out.update(budget_mib=args.budget_mib, fits=out["peak_mib"] <= args.budget_mib)
    else:
        from tfops.sharding.fully_shard import state_of
        setups = {mode: _setup(mode, widths) for mode in ("stage2", "stage3", "stage3-noprefetch")}
        steps = {mode: _stepper(m, o, x, y) for mode, (m, o) in setups.items()}
        times: dict[str, list[float]] = {mode: [] for mode in steps}
        for step in steps.values():
            step()                                    # trace and warm up
        for _ in range(3):
            for mode, step in steps.items():
                tfops.allreduce(tf.zeros([1]), name="stage3_bench.barrier")
                t = time.perf_counter()
                for _ in range(10):
                    step()
                float(tf.reshape(setups[mode][0].trainable_variables[0], [-1])[0])   # the last step has finished
                times[mode].append((time.perf_counter() - t) / 10)
        fs = state_of(setups["stage3"][0])
        if args.timeline:
            fs.exchange.write_timeline(f"{args.timeline}.rank{tfops.rank()}.json")
        out.update({f"{m}_s": statistics.median(v) for m, v in times.items()},
                   overlap=_overlap(fs.exchange.timeline, len(fs.units)),
                   overlap_noprefetch=_overlap(state_of(setups["stage3-noprefetch"][0]).exchange.timeline,
                                               len(fs.units)))
    print("RESULT " + json.dumps(out), flush=True)


def opt_model_weights(model):
    """The model's trainable weights whole-sized (a fully sharded model's, from its units)."""
    from tfops.sharding.fully_shard import state_of
    fs = state_of(model)
    return [v for u in fs.units for v in u.full_vars] if fs else model.trainable_variables


def launch(np_: int, *args: str, env: dict | None = None) -> list[dict]:
    cmd = ["allreduce-run", "-np", str(np_), sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="2", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    over = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"over_budget_mib"')]
    if over:
        return [{"np": np_, "fits": False, "over_budget_mib": over[0]["over_budget_mib"], "args": list(args)}]
    if proc.returncode != 0 or len(rows) != np_:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs="?", const="memory", dest="what")
    ap.add_argument("--part", choices=["memory", "budget", "time"])
    ap.add_argument("--mode", default="stage3")
    ap.add_argument("--modes", default="unsharded,stage2,stage3")
    ap.add_argument("--model", default="deep")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--budget-mib", type=float, default=0.0)
    ap.add_argument("--timeline", default="")
    ap.add_argument("--malloc", default="fixed,default")
    args = ap.parse_args()
    if args.what:
        return worker(args)
    print(f"$ python benchmarks/stage3_bench.py {' '.join(sys.argv[1:])}   (load: {os.getloadavg()[0]:.1f})")
    if args.part == "time":
        rows = launch(args.np, "time", "--model", args.model if args.model != "deep" else "small",
                      *(["--timeline", args.timeline] if args.timeline else []))
        for r in rows:
            print(f"rank {r['rank']}: stage2 {r['stage2_s'] * 1e3:.1f} ms  stage3 {r['stage3_s'] * 1e3:.1f} ms "
                  f"({r['stage3_s'] / r['stage2_s']:.2f}x stage 2)  stage3 no prefetch {r['stage3-noprefetch_s'] * 1e3:.1f} "
                  f"ms ({r['stage3-noprefetch_s'] / r['stage2_s']:.2f}x)  forward gathers hidden behind compute: "
                  f"{r['overlap']:.0%} (no prefetch: {r['overlap_noprefetch']:.0%})")
        return
    modes = args.modes.split(",")
    mallocs = args.malloc.split(",") if args.part == "memory" else ["default"]     # budget: glibc as it comes
    print("| malloc | np | optimizer | params | peak MiB | peak once wrapped MiB | TF + Python MiB | peak vs unsharded | fits |")
    print("|:---|---:|:---|---:|---:|---:|---:|---:|:---|")
    for malloc in mallocs:
        base = None
        for mode in modes:
            extra = ["--budget-mib", str(args.budget_mib)] if args.part == "budget" else []
            rows = launch(args.np, "memory", "--mode", mode, "--model", args.model, "--steps", str(args.steps), *extra,
                          env=FIXED_MMAP if malloc == "fixed" else None)
            if "peak_mib" not in rows[0]:
                print(f"| {malloc} | {args.np} | {mode} | | over {rows[0]['over_budget_mib']:.0f} | | | | no (killed) |")
                continue
            peak = max(r["peak_mib"] for r in rows)
            base = base or (peak if mode == "unsharded" else None)
            ratio = f"{peak / base:.2f}x" if base else "-"
            fits = "" if args.part != "budget" else ("yes" if all(r.get("fits") for r in rows) else "no")
            print(f"| {malloc} | {args.np} | {mode} | {rows[0]['params'] / 1e6:.1f} M | {peak:.0f} | "
                  f"{max(r['rss_model_mib'] for r in rows):.0f} | "
                  f"{max(r['rss_import_mib'] for r in rows):.0f} | {ratio} | {fits} |", flush=True)


if __name__ == "__main__":
    main()
