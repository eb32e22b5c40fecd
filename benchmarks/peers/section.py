"""The report's "peers" section: ours, Gloo and Horovod in one run, as launches in turn.

::

    python benchmarks/report.py --only peers          # this section alone (about 6 minutes)

Steps: 1. ``rounds`` times in turn: ours_bench.py --impl ours, --impl gloo (the project's
venv) and horovod_bench.py (``.venv-horovod``'s python and mpirun); each row keeps its fastest
launch. 2. ``rounds`` times in turn: examples/synthetic_benchmark.py (tfops) and
horovod_bench.py --measures training, both -np 2, one TF thread per rank; the median
img/s of each. A peer that cannot run here (no torch, no .venv-horovod) is a '#' line saying
why and how to install it: skipped, never faked. All launches are -np 2, bound to cores.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.peers import timing

ROOT = Path(__file__).resolve().parents[2]
HOROVOD_VENV = ROOT / ".venv-horovod"
RANKS = 2
ROUNDS = 2                      # micro launches per implementation, in turn
TRAINING_ROUNDS = 3             # training launches per library, in turn; medians
TRAINING = "examples/synthetic_benchmark.py --threads 1"


def _mpirun(bin_dir: Path | None) -> list[str]:
    mpirun = str(bin_dir / "mpirun") if bin_dir else "mpirun"
    return [mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", "core", "-np", str(RANKS)]


def commands(tmp: str, *, quick: bool) -> dict[str, list[str]]:
    """Each launch's argv (its --json goes to ``tmp``), keyed by what it times."""
    q = ["--quick", "--max-bytes", str(1 << 20)] if quick else []
    hvd_py = str(HOROVOD_VENV / "bin" / "python")
    return {
        "ours": _mpirun(None) + [sys.executable, "benchmarks/peers/ours_bench.py", "--impl", "ours", *q,
                                 "--json", f"{tmp}/ours.json"],
        "gloo": _mpirun(None) + [sys.executable, "benchmarks/peers/ours_bench.py", "--impl", "gloo", *q,
                                 "--json", f"{tmp}/gloo.json"],
        "horovod": _mpirun(HOROVOD_VENV / "bin") + [hvd_py, "benchmarks/peers/horovod_bench.py", *q,
                                                    "--json", f"{tmp}/horovod.json"],
        "train-ours": _mpirun(None) + [sys.executable, *TRAINING.split(), "--json", f"{tmp}/train-ours.json"],
        "train-horovod": _mpirun(HOROVOD_VENV / "bin") + [hvd_py, "benchmarks/peers/horovod_bench.py", "--measures",
                                                          "training", "--threads", "1", "--json",
                                                          f"{tmp}/train-horovod.json"],
    }


def shown(argv: list[str]) -> str:
    """A launch as a user types it: paths relative to the repository, no temporary --json."""
    out = []
    for a in argv[: argv.index("--json")] if "--json" in argv else argv:
        a = "python" if a == sys.executable else a
        out.append(os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a)
    return " ".join(x for x in out if x not in ("--oversubscribe", "--allow-run-as-root"))


def missing() -> dict[str, str]:
    """{peer: why it cannot run here} for the peers whose software is absent."""
    why = {}
    try:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            why["gloo"] = "torch is not importable: pip install -e '.[bench]'"
    except ValueError:
        why["gloo"] = "torch is not importable: pip install -e '.[bench]'"
    if not (HOROVOD_VENV / "bin" / "python").is_file():
        why["horovod"] = f"{_rel(HOROVOD_VENV)} is not built: bash benchmarks/peers/build_horovod.sh"
    return why


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _launch(key: str, argv: list[str], env: dict, timeout: float, log: list[str]) -> bool:
    if "horovod" in key:            # Horovod's own Open MPI (the wheel in its venv) starts its ranks
        env = dict(env, PATH=f"{HOROVOD_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    print(f"[report] peers: {shown(argv)}", file=sys.stderr, flush=True)
    start = time.time()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.append(f"# {key}: timed out after {timeout:.0f} s")
        return False
    print(f"[report]   {time.time() - start:.0f} s, exit {proc.returncode}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        log.append(f"# {key}: exited {proc.returncode}: {tail}")
        return False
    return True


def run(env: dict, timeout: float, *, quick: bool = False) -> tuple[str, dict]:
    """Run every launch; return the section's text and its JSON (rows, training, what was skipped)."""
    load = os.getloadavg()
    skipped = missing()
    micro: list[list[dict]] = []
    training: dict[str, list[float]] = {"ours": [], "horovod": []}
    log: list[str] = []
    versions: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        argv = commands(tmp, quick=quick)
        for _ in range(1 if quick else ROUNDS):
            for key in ("ours", "gloo", "horovod"):
                if key not in skipped and _launch(key, argv[key], env, timeout, log):
                    data = json.loads(Path(tmp, f"{key}.json").read_text())
                    micro.append(data["records"])
                    versions.setdefault(key, {k: v for k, v in data.items() if k not in ("records", "impl")})
        for _ in range(0 if quick else TRAINING_ROUNDS):
            for lib in ("ours", "horovod"):
                key = f"train-{lib}"
                if lib in skipped or not _launch(key, argv[key], env, timeout, log):
                    continue
                data = json.loads(Path(tmp, f"{key}.json").read_text())
                training[lib].append(data["tfops"]["total"] if lib == "ours" else data["training"]["horovod"]["total"])
                if lib == "horovod":
                    versions["horovod-training"] = {k: data["training"][k] for k in ("tensorflow", "keras")}
        cmds = {k: shown(v) for k, v in argv.items()}
    result = {"records": timing.best_of(micro), "training": training, "skipped": skipped, "log": log,
              "versions": versions, "commands": cmds, "rounds": 1 if quick else ROUNDS,
              "training_rounds": 0 if quick else TRAINING_ROUNDS, "machine": common.machine_description()}
    result["machine"]["loadavg"] = [round(x, 2) for x in load]
    return render(result), result


def render(data: dict) -> str:
    """The section's text: the legend, the launches, the rows, the training medians."""
    lines = [f"# peers: -np {RANKS}, float32, op average; every launch bound to cores; rows: the fastest of "
             f"{data['rounds']} launch(es) per implementation, in turn",
             f"# load average at the start: {' '.join(map(str, data['machine'].get('loadavg', [])))} "
             f"on {data['machine'].get('cores')} cores"]
    lines += [f"#   {impl:8} {what}" for impl, what in timing.IMPLS.items()]
    lines += [f"# launch {k}: {v}" for k, v in data["commands"].items()]
    lines += [f"# skipped {peer}: {why}" for peer, why in data["skipped"].items()] + data["log"]
    lines += timing.format_table(data["records"])
    ours, hvd = data["training"]["ours"], data["training"]["horovod"]
    if ours or hvd:
        tf_h = data["versions"].get("horovod-training", {})
        lines += ["", f"# training: examples/synthetic_benchmark.py's small CNN, batch 32 per rank, -np {RANKS}, "
                      f"one TF thread per rank; total img/s, median of {data['training_rounds']} launches in turn",
                  f"# ours: tfops on TF 2.21 / Keras 3; horovod: horovod.tensorflow on TF "
                  f"{tf_h.get('tensorflow', '2.12')} / Keras {tf_h.get('keras', '2')}; Gloo: not run (its "
                  "training path is torch DDP: another framework and model code, not the same step)"]
        for lib, totals in (("ours", ours), ("horovod", hvd)):
            if totals:
                lines.append(f"  training {lib:>8} {statistics.median(totals):>8.1f} img/s   launches: "
                             + ", ".join(f"{x:.1f}" for x in totals))
    return "\n".join(lines)
