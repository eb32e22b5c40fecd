"""The pipeline's bubble and memory, measured: idle time per rank against (p-1)/m and (p-1)/(v m).

::

    python benchmarks/pipeline_bench.py --part bubble      # -np 2: gpipe, 1f1b, interleaved (v=2) x m = 4, 8, 16
    python benchmarks/pipeline_bench.py --part memory      # -np 2: peak live activations and RSS, gpipe vs 1f1b

Each part launches ``mpirun -np P python benchmarks/pipeline_bench.py --worker ...``; the ranks
print one JSON line per case, rendered here as the table for BENCHMARKS.md.

bubble   a deep MLP (8 Dense layers of --width, tanh), cut into p stages (interleaved: 2p chunks),
         trained with ``Pipeline`` under ``tfops.start_timeline``; after 2 warm-up steps, each of
         --steps steps is one SCHEDULE span on the rank's timeline, and the FORWARD / BACKWARD
         spans inside it are its compute. idle/busy = (step - compute) / compute, the median over
         steps, where a step runs from the rank's SCHEDULE start to the latest SCHEDULE end of any
         rank (the pipeline's step: a stage that finished early idles until the last one does;
         one monotonic clock on one machine): what ``(p-1)/(v m)`` predicts when the stages take
         equal time and messages are free. In parentheses, the rank's own SCHEDULE span in place of
         the step: the last stage finishes first, so its own span misses the step's tail. Ranks
         meet at a barrier before each step, so a step's span starts together. The ranks
         are not bound to cores (``--bind-to none``): bound, each shares its core with whatever else
         the machine runs there, and the stages stop taking equal time.
memory   the same model with a micro-batch of --mem-rows rows: ``Pipeline.peak_live`` (forward tapes
         alive at once, the schedule's count) and the RSS: ``ru_maxrss`` after the steps less the RSS
         before the first step, one launch per schedule (``ru_maxrss`` only grows).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _worker(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    import keras

    import tfops
    from tfops.parallel import Mesh
    from tfops.parallel.pipeline import Pipeline
    tfops.init()
    mesh = Mesh(pipeline=tfops.size())
    p, rank = mesh.pipeline, mesh.pipeline_rank
    layers = 8

    def chunks(v):
        per = layers // (p * v)
        return [keras.Sequential([keras.Input((args.width,))] + [
            keras.layers.Dense(args.width, activation="tanh", kernel_initializer=keras.initializers.RandomNormal(
                stddev=args.width ** -0.5, seed=j)) for j in range(per)]) for _ in range(v)]

    cases = [(s, m) for s in args.schedules.split(",") for m in [int(x) for x in args.ms.split(",")]]
    for schedule, m in cases:
        v = 2 if schedule == "interleaved" else 1
        built = chunks(v)
        pipe = Pipeline(built if v > 1 else built[0], mesh, m, schedule, loss="mse")
        rows = args.rows * m
        x = np.random.default_rng(0).standard_normal((rows, args.width)).astype(np.float32)
        opt = keras.optimizers.SGD(1e-3)
        rss0 = _rss_mib()
        path = f"/tmp/pipeline_bench.{os.getpid()}.{schedule}.{m}.json"
        spans = []                                              # (start, end) of each timed step's schedule
        for step in range(2 + args.steps):
            if step == 2:
                tfops.start_timeline(path)
            pipe.p2p.exchange_objects(None)                     # a barrier: the step starts together
            pipe.train_step(x, x, opt)
            if step >= 2:
                spans.append(pipe.schedule_span)
        tfops.stop_timeline()
        mine = path if tfops.rank() == 0 else path.replace(".json", f".rank{tfops.rank()}.json")
        events = [json.loads(line.rstrip(",\n")) for line in open(mine) if line.startswith("{")]
        steps = [e for e in events if e.get("name") == "SCHEDULE"]
        # the pipeline's step ends when its last stage to finish does (time.monotonic is one clock
        # for every process of the machine): a stage that finished early idles until then too
        ends = [max(e) for e in zip(*[[end for _, end in r] for r in pipe.p2p.exchange_objects(spans)])]
        ratios, own = [], []
        for s, (start, _), end in zip(steps, spans, ends):
            lo, hi = s["ts"], s["ts"] + s["dur"]
            busy = sum(e["dur"] for e in events if e.get("name") in ("FORWARD", "BACKWARD") and lo <= e["ts"] <= hi)
            ratios.append(((end - start) * 1e6 - busy) / busy)
            own.append((s["dur"] - busy) / busy)
        for f in (path, mine):
            if os.path.exists(f):
                os.remove(f)
        print(json.dumps({"schedule": schedule, "p": p, "v": v, "m": m, "rank": rank,
                          "idle_busy": sorted(ratios)[len(ratios) // 2], "formula": (p - 1) / (v * m),
                          "idle_busy_own_span": sorted(own)[len(own) // 2],
                          "step_ms": sum(s["dur"] for s in steps) / len(steps) / 1e3,
                          "peak_live": pipe.peak_live,
                          "rss_growth_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0}),
              flush=True)


def _launch(np_: int, extra: list[str]) -> list[dict]:
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_), "-x", "OMP_NUM_THREADS=1",
           "-x", "TF_NUM_INTRAOP_THREADS=1", "-x", "TF_CPP_MIN_LOG_LEVEL=2",
           sys.executable, os.path.abspath(__file__), "--worker"] + extra
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not rows:
        sys.exit(f"pipeline_bench: {' '.join(cmd)} failed ({out.returncode}):\n"
                 f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("bubble", "memory"), default="bubble")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    parser.add_argument("--ms", default="4,8,16")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64, help="rows a micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    print("$ python benchmarks/pipeline_bench.py " + " ".join(sys.argv[1:]))
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.part == "bubble":
        common = ["--schedules", args.schedules, "--ms", args.ms, "--width", str(args.width),
                  "--rows", str(args.rows), "--steps", str(args.steps)]
        rows = _launch(args.np, common)
        print(f"\np = {args.np}, 8 Dense layers of {args.width}, {args.rows} rows a micro-batch, "
              f"median of {args.steps} steps; idle/busy from each rank's timeline, to the step's end "
              f"(to the end of the rank's own schedule)\n")
        print("| schedule | v | m | formula (p-1)/(v m) | " + " | ".join(f"rank {r} idle/busy" for r in range(args.np))
              + " | step ms (rank 0) |")
        print("|---|---|---|---|" + "---|" * args.np + "---|")
        for key in dict.fromkeys((r["schedule"], r["m"]) for r in rows):
            mine = sorted((r for r in rows if (r["schedule"], r["m"]) == key), key=lambda r: r["rank"])
            print(f"| {key[0]} | {mine[0]['v']} | {key[1]} | {mine[0]['formula']:.3f} | "
                  + " | ".join(f"{r['idle_busy']:.3f} ({r['idle_busy_own_span']:.3f})" for r in mine)
                  + f" | {mine[0]['step_ms']:.0f} |")
    else:
        print(f"\np = {args.np}, m = 16, 8 Dense layers of {args.width}, {args.rows} rows a micro-batch: "
              f"one launch per schedule\n")
        print("| schedule | rank | peak live activations (schedule) | RSS growth over the steps, MiB |")
        print("|---|---|---|---|")
        for schedule in ("gpipe", "1f1b"):
            rows = _launch(args.np, ["--schedules", schedule, "--ms", "16", "--width", str(args.width),
                                     "--rows", str(args.rows), "--steps", "1"])
            for r in sorted(rows, key=lambda r: r["rank"]):
                print(f"| {schedule} | {r['rank']} | {r['peak_live']} | {r['rss_growth_mib']:.0f} |")
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
