"""Activation recompute on the project's GPT (examples/gpt.py): the activation peak with and without it.

    python benchmarks/recompute_bench.py                                   # the table below, one process a mode
    python benchmarks/recompute_bench.py --layers 4 --hidden 128 --seq 256 --batch 32

Modes (each in a fresh process, the same model, weights and batch):

* ``none``: every activation the forward makes is kept for backprop;
* ``full``: each transformer block's call through ``keras.remat`` (Megatron's full checkpointing, one
  block a chunk): only the blocks' inputs are kept, and a block's inside is made again in backprop.

Two numbers per mode, both load-independent (memory, not time):

* **kept**: the bytes of the forward tensors the backward pass reads in the traced step (what must
  stay alive from forward to backward), counted in the step's graph as ``plan_bench`` counts them;
* **peak**: the first run's peak RSS above the RSS just before it (the step already traced and Adam's
  slots made): ``VmHWM`` after the step less ``VmRSS`` before, the high-water mark reset through
  ``/proc/self/clear_refs``, with ``MALLOC_MMAP_THRESHOLD_=131072``. Later runs reuse memory the
  allocator kept from the first, so only the first is measured. It holds the recompute's transient
  (one block's inside, remade in backprop), the gradients and Adam's update.

The losses of the two modes' steps are printed: recompute must not change them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = float(1 << 20)
MODES = ("none", "full")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024


def worker(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT))
    import keras
    import numpy as np
    import tensorflow as tf

    import gpt
    from benchmarks.plan_bench import kept_activation_bytes

    cfg = gpt.Config(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab)
    model = gpt.build(cfg, None, seed=0)
    if args.mode == "full":
        for block in model.blocks:                 # one checkpoint per transformer block
            block.call = keras.remat(block.call)
    opt = keras.optimizers.Adam(1e-3)
    step = gpt.train_step_fn(model, opt, model.mesh)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.integers(0, cfg.vocab, (args.batch, cfg.seq)), tf.int32)
    y = tf.constant(rng.integers(0, cfg.vocab, (args.batch, cfg.seq)), tf.int32)
    concrete = step.get_concrete_function(x, y)      # traced (Adam's slots made) before the peak is reset
    kept = kept_activation_bytes(concrete.graph, concrete.outputs[0])
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                 # VmHWM := VmRSS
    losses = [float(step(x, y))]                     # the first run: every buffer is new memory
    peak = _status("VmHWM") - before                 # (later runs reuse what the allocator kept)
    losses += [float(step(x, y)) for _ in range(args.steps)]
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return {"mode": args.mode, "kept": kept, "peak": peak, "losses": losses, "params": params}


def run_mode(mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                          ("layers", "hidden", "heads", "seq", "vocab", "batch", "steps")]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"recompute_bench: mode {mode} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="steps after the measured one (their losses are compared)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.mode = args.worker
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    print(f"# {' '.join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}")
    print(f"# GPT: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}, "
          f"batch {args.batch}; float32, Adam, one process; MALLOC_MMAP_THRESHOLD_=131072; "
          f"{time.strftime('%H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}")
    rows = [run_mode(m, args) for m in MODES]
    base = rows[0]
    print(f"# {base['params']} parameters")
    print(f"{'recompute':>10} {'kept MiB':>10} {'x lower':>8} {'peak MiB':>10} {'x lower':>8}  losses")
    for r in rows:
        print(f"{r['mode']:>10} {r['kept'] / MIB:10.1f} {base['kept'] / r['kept']:8.2f} {r['peak'] / MIB:10.1f} "
              f"{base['peak'] / max(r['peak'], 1):8.2f}  {' '.join(f'{v:.6f}' for v in r['losses'])}")
    same = all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for r in rows[1:] for a, b in zip(r["losses"], base["losses"]))
    print(f"# losses equal with and without recompute (1e-5): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
