"""A chaos run: many faults in one elastic job (kill, exception, hang on random ranks), a regrow after each.

::

    python benchmarks/elastic_chaos.py                          # -np 4 --max-np 4, 9 faults, seed 1, bound 5 s
    python benchmarks/elastic_chaos.py --faults 12 --seed 7 --bound 5 --slow

One launch of ``allreduce-run --elastic -np N --max-np N python tests/mpi/elastic_train.py``.
The plan, made here before the launch (seeded)::

    fault i at step 4 + 6 i, kind cycling kill, raise, hang:
        kill   SIGKILL in compute or inside an allreduce (ring, engine, shared-memory mailbox)
        raise  RuntimeError in compute or between two collectives (the rank leaves, failure.py)
        hang   SIGSTOP for good (the others evict it after --bound s without a heartbeat)
    the victim: a random process alive at that step, rank 0 included (names 0..N-1 at the start,
    replacements N, N+1, ...: each fault is followed, at the next commit, by a regrow)
    --slow: one rank pauses (SIGSTOP, SIGCONT 2 s later) between two faults: slow, not hung

A commit every 3 steps, so each fault costs at most 2 steps again, and the world is
whole again before the next fault. The checks: the launcher exits 0; every process
alive at the end prints the same bits, equal to a numpy replay of the committed
lineage (``tests/mpi/elastic_train.py``'s ``replay``, step by step at the sizes the
job ran); the launcher's last line names every victim (died, raised, evicted); the
slow rank is not evicted. Then one row per fault, in seconds from the fault:

    detect   the survivors noticed (the time in their "died (noticed at ...)" line)
    step     the first step done on the smaller world
    whole    the first step done at N ranks again (after the regrow's spawn and sync)

tests/test_elastic_hang.py runs a short cycle of this (kill, raise, hang, a slow pause).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "mpi" / "elastic_train.py"
FIRST, SPACING, EVERY = 4, 6, 3
KINDS = ("kill", "raise", "hang")
_PHASES = {"kill": ("compute", "ring", "engine", "mailbox"), "raise": ("compute", "collective"), "hang": ("hang",)}


def plan(np_: int, faults: int, seed: int, *, slow: bool = False) -> list[tuple[str, int, int, str]]:
    """``(kind, name, step, phase)`` per fault (and a ``slow`` entry), the victims drawn from who is alive."""
    rng = random.Random(seed)
    alive, fresh, out = list(range(np_)), np_, []
    for i in range(faults):
        kind, step = KINDS[i % 3], FIRST + SPACING * i
        victim = rng.choice(alive)
        out.append((kind, victim, step, rng.choice(_PHASES[kind])))
        alive.remove(victim)
        alive.append(fresh)                    # the regrow at the next commit brings in the next name
        fresh += 1
    if slow and faults >= 2:                   # after the second fault, on a rank no later fault hits
        spared = [name for name in range(fresh) if name not in {v for _, v, _, _ in out}
                  and (name < np_ or name - np_ < 2)]
        out.insert(2, ("slow", rng.choice(spared), FIRST + SPACING + SPACING // 2 + 1, "slow"))
    return out


def launch(np_: int, faults: list[tuple[str, int, int, str]], *, bound: float, timeout: float = 600.0,
           env: dict | None = None) -> subprocess.CompletedProcess:
    kills = ",".join(f"{name}@{step}:{phase}" for kind, name, step, phase in faults if kind in ("kill", "hang", "slow"))
    raises = ",".join(f"{name}@{step}:{phase}" for kind, name, step, phase in faults if kind == "raise")
    steps = max(step for _, _, step, _ in faults) + SPACING
    full = {**os.environ, "ELASTIC_KILLS": kills, "ELASTIC_RAISES": raises, "ELASTIC_STEPS": str(steps),
            "ELASTIC_COMMIT_EVERY": str(EVERY), "ALLREDUCE_ELASTIC_HANG_TIMEOUT": f"{bound:g}",
            "ALLREDUCE_ELASTIC_RECOVERY_TIMEOUT": "30", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    cmd = [sys.executable, "-m", "allreduce.run", "--elastic", "-np", str(np_), "--max-np", str(np_),
           sys.executable, str(SCRIPT)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)          # the launcher, mpirun and every rank
        out, err = proc.communicate()
        raise TimeoutError(f"the chaos launch did not end within {timeout:g} s\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _day(t: float) -> float:
    d = datetime.fromtimestamp(t, timezone.utc)
    return d.hour * 3600 + d.minute * 60 + d.second + d.microsecond / 1e6


def _clock(text: str) -> float:
    h, m, s = text.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def replay(sizes: list[int]):
    spec = importlib.util.spec_from_file_location("elastic_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.replay(sizes)


def check(np_: int, faults, result: subprocess.CompletedProcess) -> tuple[list[dict], list[str]]:
    """The table's rows and the list of what went wrong (empty: every check passed)."""
    out, err = result.stdout, result.stderr
    problems = []
    if result.returncode != 0:
        problems.append(f"the launcher exited {result.returncode}")
    finals = re.findall(r"^FINAL (\d+) (\d+) (\w+) (\w+) ([\d,]+) resets=", out, re.M)
    if len({f[1:] for f in finals}) != 1 or len(finals) != np_:
        problems.append(f"{len(finals)} FINAL lines, {len({f[1:] for f in finals})} different")
    else:
        sizes = [int(s) for s in finals[0][4].split(",")]
        w, v = replay(sizes)
        if (w.tobytes().hex(), v.tobytes().hex()) != finals[0][2:4]:
            problems.append("the final state differs from the numpy replay of the committed lineage")
    summary = ([line for line in err.splitlines() if line.startswith("allreduce-run: elastic job")] or [""])[-1]
    noticed = {int(n): _clock(t) for ranks, t in re.findall(r"allreduce-elastic: (rank [^;]*?) died "
                                                             r"\(noticed at ([\d:.]+) UTC\)", err)
               for n in re.findall(r"\(name (\d+)\)", ranks)}
    resumed = [(int(s), float(t)) for s, t in re.findall(r"^RESUMED (\d+) ([\d.]+)$", out, re.M)]
    rows = []
    for kind, name, step, phase in faults:
        tag = {"kill": "KILL", "raise": "RAISE", "hang": "HANG", "slow": "SLOW"}[kind]
        hit = re.search(rf"^{tag} {name} step {step} .*?at ([\d.]+)$", out, re.M)
        if hit is None:
            problems.append(f"{kind} of name {name} at step {step} did not happen")
            continue
        at = float(hit.group(1))
        if kind == "slow":
            if re.search(rf"\(name {name}, pid", summary) or name in noticed:
                problems.append(f"the slow rank (name {name}) was evicted")
            rows.append({"kind": "slow", "name": name, "step": step, "detect": None, "step_s": None, "whole": None})
            continue
        if name not in noticed:
            problems.append(f"the {kind} of name {name} was never noticed")
            continue
        if not re.search(rf"(\(name {name}\) failed with|\(name {name}, pid \d+ on \S+\) with SIGKILL|"
                         rf"\(name {name}\)[^;]* died at)", summary):
            problems.append(f"the summary does not name {name}")
        detect = (noticed[name] - _day(at)) % 86400
        first = next((t - at for s, t in resumed if t > at and s < np_), None)
        whole = next((t - at for s, t in resumed if t > at and s == np_), None)
        rows.append({"kind": kind, "name": name, "step": step, "phase": phase, "detect": detect,
                     "step_s": first, "whole": whole})
    return rows, problems


def table(rows: list[dict]) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"
    lines = [f"{'#':>3} {'kind':<6} {'name':>4} {'step':>4} {'where':<10} {'detect s':>9} {'step s':>7} {'whole s':>8}"]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3} {r['kind']:<6} {r['name']:>4} {r['step']:>4} {r.get('phase', ''):<10} "
                     f"{f(r['detect']):>9} {f(r['step_s']):>7} {f(r['whole']):>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-np", "--np", dest="np_", type=int, default=4)
    parser.add_argument("--faults", type=int, default=9)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--bound", type=float, default=5.0, help="elastic_hang_timeout, seconds")
    parser.add_argument("--slow", action="store_true", help="also one slow pause (2 s, under the bound)")
    args = parser.parse_args(argv)
    faults = plan(args.np_, args.faults, args.seed, slow=args.slow)
    print(f"# command: python benchmarks/elastic_chaos.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# uptime: {os.popen('uptime').read().strip()}")
    started = time.monotonic()
    result = launch(args.np_, faults, bound=args.bound)
    rows, problems = check(args.np_, faults, result)
    print(f"# -np {args.np_} --max-np {args.np_}, {args.faults} faults, seed {args.seed}, hang bound "
          f"{args.bound:g} s, one launch of {time.monotonic() - started:.0f} s; seconds from each fault")
    print(table(rows))
    summary = [line for line in result.stderr.splitlines() if line.startswith("allreduce-run: elastic job")]
    print(f"# launcher exit {result.returncode}: {(summary or ['(no summary)'])[-1][:300]}...")
    print("# FAILED: " + "; ".join(problems) if problems else
          "# OK: final state bitwise equal on every rank and to the numpy replay; every victim named")
    if problems:
        sys.stderr.write(result.stderr[-6000:])
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
