"""Where TensorFlow's CPU pool put issue 44's user measurement: the BFC allocator's own log, per rank.

::

    python benchmarks/pool_trace.py                      # 4 launches, stage 2, -np 2
    python benchmarks/pool_trace.py --mode unsharded --launches 2
    python benchmarks/pool_trace.py --save               # and keep the lines for BENCHMARKS.md

Each launch runs ``sharding_bench.py``'s user worker (16.8 M-parameter MLP, batch 32, 5 Adam
steps in a ``tf.function``) at -np 2 with oneDNN on, TensorFlow's default, whose CPU tensors
come from a BFC pool ("mklcpu"), and with ``TF_CPP_VMODULE=bfc_allocator=3,executor=1``: the pool
then logs every region it reserves and the address of every block it hands out, and the
executor each op a thread runs (so a block is named by the op that asked for it). Each rank's log goes
to a file of its own (``--keep DIR`` keeps them). Per rank it prints:

- ``regions``: the sizes of the regions the pool reserved (MiB, in order), and how many of their
  bytes it ever handed out (``handed out``: the union of every block's ``[address, address +
  size)``; a block is written when it is filled, so these pages are resident, and the pool
  never gives a region back);
- ``batch``: whether TensorFlow copied the batch array into the pool (``copied``) or wrapped it
  without a copy (``wrapped``; which one follows the array's address: docs/notes.md, lesson 14);
- ``new pages``: each block of 1 MiB or more that brought pages not handed out before: how many
  MiB, in which region, at which offset (the model's build comes first: its kernel and its
  initializer's two temporaries);
- ``above model``: ``ru_maxrss`` after the steps less ``ru_maxrss`` once the model was built.

``--save`` keeps the lines in benchmarks/results/sharding.json (key ``pool_trace``), which
``sharding_bench.py --write`` renders into BENCHMARKS.md "Sharding" beside the user measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 2 ** 20
REGION = re.compile(r"Allocated memory at (0x[0-9a-f]+) to (0x[0-9a-f]+)")
BLOCK = re.compile(r"AllocateRaw mklcpu\s+(\d+) (0x[0-9a-f]+)")
NODE = re.compile(r"Process node: .*\{\{node (\S+)\}\}")          # executor.cc: the op a thread runs


def _worker(log_dir: str, worker_args: list[str]) -> None:
    """One rank: stderr (TF's log) to ``log_dir/rank.N.log``, then sharding_bench's worker."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    fd = os.open(os.path.join(log_dir, f"rank.{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    sys.path.insert(0, str(HERE))
    import sharding_bench
    sharding_bench.main(["--worker", *worker_args])


def read_log(path: Path) -> dict:
    """The regions (MiB), the bytes ever handed out, and each block of 1 MiB or more that brought
    pages not handed out before: (MiB new, region, offset in MiB, the op of a step that asked, or
    "eager"), in the order they came."""
    regions, handed, fresh, op = [], [], [], {}
    for line in path.read_text(errors="replace").splitlines():
        words = line.split()
        thread = words[2] if len(words) > 2 else ""
        if (m := NODE.search(line)):
            op[thread] = m.group(1)
        elif (m := REGION.search(line)):
            regions.append((int(m.group(1), 16), int(m.group(2), 16)))
        elif (m := BLOCK.search(line)):
            size, at = int(m.group(1)), int(m.group(2), 16)
            new = size - sum(max(0, min(hi, at + size) - max(lo, at)) for lo, hi in handed)
            if new and size >= MIB:
                r = next(i for i, (lo, hi) in enumerate(regions) if lo <= at < hi)
                fresh.append((new / MIB, r + 1, (at - regions[r][0]) / MIB, op.get(thread, "eager")))
            handed = _merge(handed + [(at, at + size)])
    return {"regions": [(hi - lo) / MIB for lo, hi in regions], "handed_mib": sum(hi - lo for lo, hi in handed) / MIB,
            "fresh": fresh}


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def launch(mode: str, keep: str | None) -> list[str]:
    log_dir = keep or tempfile.mkdtemp(prefix="pool_trace.")
    os.makedirs(log_dir, exist_ok=True)
    args = ["memory", "--mode", mode, "--model", "user", "--steps", "5", "--batch", "32"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="bfc_allocator=3,executor=1", OMP_NUM_THREADS="1",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)               # the pool: TensorFlow as it comes
    cmd = ["allreduce-run", "-np", "2", sys.executable, __file__, "--worker", log_dir, "--", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(rows) != 2:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    out = []
    for r in sorted(rows, key=lambda r: r["rank"]):
        got = read_log(Path(log_dir) / f"rank.{r['rank']}.log")
        out.append(f"rank {r['rank']}: above model {r['peak_mib'] - r['rss_model_mib']:.1f} MiB; batch "
                   f"{'copied' if r.get('batch_in_pool') else 'wrapped'}; regions "
                   f"{' + '.join(f'{x:.0f}' for x in got['regions'])} MiB, handed out {got['handed_mib']:.1f}; new "
                   "pages (MiB at region+offset): " + ", ".join(f"{n:.1f} at {r_}+{o:.1f} ({name})" for n, r_, o, name in got["fresh"]))
    if not keep:
        for f in Path(log_dir).iterdir():
            f.unlink()
        os.rmdir(log_dir)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1], argv[3:])                        # --worker DIR -- worker args
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="stage2", choices=["unsharded", "stage1", "stage2"])
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--keep", default=None, help="keep each launch's rank logs under this folder")
    parser.add_argument("--save", action="store_true", help="keep the lines in benchmarks/results/sharding.json")
    args = parser.parse_args(argv)
    command = f"python benchmarks/pool_trace.py --mode {args.mode} --launches {args.launches}"
    print(f"# {command}: -np 2, TF's pool (oneDNN on), TF_CPP_VMODULE=bfc_allocator=3,executor=1", flush=True)
    started, load, lines = time.strftime("%H:%M UTC", time.gmtime()), os.getloadavg(), []
    for k in range(args.launches):
        for line in launch(args.mode, os.path.join(args.keep, str(k)) if args.keep else None):
            lines.append(f"launch {k}, {line}")
            print(lines[-1], flush=True)
    if args.save:
        sys.path.insert(0, str(HERE))
        from sharding_bench import RESULTS
        saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        saved["pool_trace"] = {"command": command, "when": started, "lines": lines,
                               "load": f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"}
        RESULTS.write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
