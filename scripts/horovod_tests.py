"""Run Horovod's own TensorFlow test files against tfops: the yardstick of issues 27 and 35.

::

    python scripts/horovod_tests.py test_tensorflow.py --np 2 --no-gpu
    python scripts/horovod_tests.py test_tensorflow2_keras.py --np 2 --keras3
    python scripts/horovod_tests.py --elastic --keras3
    python scripts/horovod_tests.py /some/checkout/test/parallel/test_tensorflow.py --np 2

Horovod's test files are not part of this repository. A bare name is taken
from Horovod's git repository at ``--tag`` (default ``v0.28.1``; the
repository is ``--horovod-git``, a bare clone such as the search tool's
``fetch`` of ``horovod/horovod``): ``git archive`` extracts its ``test/``
(``parallel/``, ``utils/``, ``integration/``) into a temporary directory. A
path is used as it is (with its ``../utils``). Every test runs in its own
``mpirun -np N python -m pytest FILE::CLASS::TEST`` under a timeout, so one
failing or hanging test cannot take the others with it (``--chunk N``: N tests per
``mpirun``, TensorFlow imported once; a test without a verdict, or a chunk that
hangs, runs again alone); the table prints
pass / fail / skip / hang per test, then the counts. ``--elastic`` runs
Horovod's elastic integration worker instead (scripts/horovod_elastic.py).

The only change to the test is a module alias, put first on ``PYTHONPATH`` in
a temporary directory:

====================================  ======================================
``horovod.tensorflow[.X]``            ``tfops[.X]`` (the same module objects)
``horovod.tensorflow.keras[.X]``      ``tfops.keras[.X]``
``horovod.keras[.X]``                 ``tfops.keras[.X]`` (Horovod's standalone-Keras binding has the same API)
``horovod.common.util``               the test file's version helper only (not API)
====================================  ======================================

Verdicts: ``pass``; ``tf1`` when the eager half of a test passes and only its
TF1 half fails (``test_tensorflow.py`` runs every test twice,
``run_all_in_graph_and_eager_modes``: in a ``tf.compat.v1`` graph with
``Session.run``, then eagerly); ``fail``; ``skip``; ``hang`` (past
``--timeout``); ``gpu`` (not launched, ``--no-gpu``).

``--keras3`` also applies Keras 3 spellings that real Horovod under Keras 3
would need too (Keras 2 names removed in Keras 3), each listed in
``KERAS3_SPELLINGS``; ``optimizer_v2.OptimizerV2`` subclasses that implement
``_resource_apply_dense`` become Keras 3 optimizers whose ``update_step``
calls it. ``--extra-path`` puts test-only packages (``parameterized``) on the path
without installing them into the project's environment, e.g.
``pip install --target /tmp/hvdtests/site parameterized``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from horovod_setup import (HOROVOD_GIT, KERAS3_SPELLINGS, ROOT, TAG, environment, extract,  # noqa: F401 - scripts/
                           kill_tagged, make_alias_dir)


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?)")
_SUBTESTS_PASSED = re.compile(r"(\d+) subtests passed")
_SUBFAILED = re.compile(r"SUBFAILED\[(\w+)\]")      # in the -rf summary: which half of a test failed


def collect(test_file: Path, env: dict) -> list[str]:
    """Test ids (``file::Class::test``), one process, no mpirun."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(test_file)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=test_file.parent)
    ids = [line.strip() for line in proc.stdout.splitlines() if line.startswith(test_file.name + "::")]
    if not ids:
        raise SystemExit(f"collected no tests from {test_file}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return ids


def _launch(np_: int, pytest_args: list[str], test_file: Path, timeout: float, env: dict
            ) -> tuple[int | None, str]:
    """One ``mpirun -np np_ python -m pytest -q ...`` beside ``test_file``: (return code, output), or
    (None, the output so far) when it ran past ``timeout`` (its process group and tagged ranks killed)."""
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "pytest",
           "-q", "-p", "no:cacheprovider", *pytest_args]
    env = dict(env, HVDTESTS_TAG=uuid.uuid4().hex)
    proc = subprocess.Popen(cmd, env=env, cwd=test_file.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_tagged(env["HVDTESTS_TAG"])
        out, _ = proc.communicate()
        return None, out


def run_one(test_id: str, test_file: Path, np_: int, timeout: float, env: dict) -> tuple[str, str, float]:
    """One mpirun for one test; returns (verdict, the last lines of output, seconds)."""
    start = time.monotonic()
    returncode, out = _launch(np_, ["-x", "-rfEs", test_id], test_file, timeout, env)
    if returncode is None:
        return "hang", out[-1500:], time.monotonic() - start
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for n, kind in _SUMMARY.findall(out):
        counts["error" if kind.startswith("error") else kind] += int(n)
    failed_modes = set(_SUBFAILED.findall(out))
    eager_passed = sum(int(n) for n in _SUBTESTS_PASSED.findall(out)) >= np_
    if counts["failed"] and failed_modes == {"graph_mode"} and eager_passed and not counts["error"]:
        verdict = "tf1"            # the eager half passes; only the TF1-session (graph mode) half fails
    elif counts["failed"] or counts["error"] or returncode not in (0,) and not counts["skipped"]:
        verdict = "fail"
    elif counts["passed"] >= np_:
        verdict = "pass"
    elif counts["skipped"]:
        verdict = "skip"
    else:
        verdict = "fail"
    return verdict, out[-1500:], time.monotonic() - start


_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SUBFAILED\[(\w+)\]) (\S+::\S+)", re.M)   # -rA summary lines


def run_chunk(test_ids: list[str], test_file: Path, np_: int, timeout: float, env: dict) -> list[tuple]:
    """One mpirun for several tests (TensorFlow's import once, not per test); returns (id, verdict, tail,
    seconds) per test. A test the summary gives no verdict for (skipped: pytest names only its line;
    not reached), every test of a chunk that hangs, and a test that failed there (an earlier test of
    the chunk may have left the library in a state Horovod's per-test verdict should not see) runs
    again alone (:func:`run_one`), whose verdict counts; its tail then starts with the chunk's."""
    if len(test_ids) == 1:
        return [(test_ids[0], *run_one(test_ids[0], test_file, np_, timeout, env))]
    start = time.monotonic()
    returncode, out = _launch(np_, ["--color=no", "-rA", *test_ids], test_file, timeout, env)  # mpirun's pty would color
    if returncode is None:
        out = ""                        # a hung chunk: every test in it runs again alone
    seconds = (time.monotonic() - start) / len(test_ids)
    seen: dict[str, list[str]] = {t: [] for t in test_ids}
    for kind, mode, test_id in _OUTCOME.findall(out):
        if test_id in seen:
            seen[test_id].append(f"SUB:{mode}" if mode else kind)
    results = []
    for test_id, kinds in seen.items():
        modes = {k[4:] for k in kinds if k.startswith("SUB:")}
        if "FAILED" in kinds or "ERROR" in kinds or modes - {"graph_mode"}:
            verdict = "fail"
        elif modes:
            verdict = "tf1" if kinds.count("PASSED") >= np_ else "fail"   # only the TF1-session half failed
        elif kinds.count("PASSED") >= np_:
            verdict = "pass"
        else:
            results.append((test_id, *run_one(test_id, test_file, np_, timeout, env)))
            continue
        lines = [line for line in out.splitlines() if test_id in line and not line.startswith("PASSED")]
        if verdict == "fail":
            alone, tail, alone_seconds = run_one(test_id, test_file, np_, timeout, env)
            results.append((test_id, alone, f"in a chunk: {chr(10).join(lines)[-600:]}\nalone: {tail}",
                            seconds + alone_seconds))
            continue
        results.append((test_id, verdict, "\n".join(lines)[-1500:], seconds))
    return results


def _test_dir(args) -> Path:
    """Horovod's ``test/``: ``--test-dir``, or extracted from ``--horovod-git`` at ``--tag``."""
    return args.test_dir.resolve() if args.test_dir else extract(args.horovod_git, args.tag)


def _run_elastic(args) -> int:
    from horovod_elastic import run_elastic            # scripts/ is on sys.path: this file's directory
    tests = _test_dir(args)
    work, worker = make_alias_dir(tests / "integration" / "data" / "elastic_tensorflow2_main.py", args.keras3,
                                  args.source.resolve())
    env = environment(work, args.extra_path, args.source.resolve())
    print(f"# {' '.join(sys.argv)}\n# Horovod {args.tag if not args.test_dir else args.test_dir}: "
          f"integration/data/elastic_tensorflow2_main.py, allreduce-run --elastic -np 4, timeout {args.timeout:g} s",
          flush=True)
    results = run_elastic(work, worker, env, timeout=args.timeout, names=[n for n in args.k.split(",") if n] or None)
    for name, (verdict, detail, seconds) in results.items():
        print(f"{verdict:5s} {seconds:6.1f}s  {name}: {detail.splitlines()[0] if detail else ''}", flush=True)
    if args.log:
        args.log.write_text("".join(f"===== {v} {n}\n{d}\n" for n, (v, d, _) in results.items()))
    print("# elastic: " + ", ".join(f"{sum(1 for v, _, _ in results.values() if v == k)} {k}"
                                    for k in ("pass", "fail", "hang")))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("test_file", nargs="?", help="a name in Horovod's test/parallel/ at --tag, or a path")
    parser.add_argument("--tag", default=TAG, help="Horovod's git tag to take the tests from")
    parser.add_argument("--horovod-git", type=Path, default=HOROVOD_GIT, help="Horovod's (bare) git directory")
    parser.add_argument("--test-dir", type=Path, help="Horovod's test/ directory, instead of --tag's")
    parser.add_argument("--elastic", action="store_true", help="run the elastic integration worker's scenarios")
    parser.add_argument("--np", type=int, default=2, dest="np_")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per mpirun (then: hang)")
    parser.add_argument("--jobs", type=int, default=1, help="tests run at the same time")
    parser.add_argument("--chunk", type=int, default=1,
                        help="tests per mpirun (TensorFlow imported once per chunk; default 1: each alone)")
    parser.add_argument("-k", default="", help="only test ids containing this (a,b: either; --elastic: scenario names)")
    parser.add_argument("--keras3", action="store_true", help="apply KERAS3_SPELLINGS to the copy")
    parser.add_argument("--extra-path", action="append", default=[], help="test-only packages dir")
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="the tree whose allreduce/ and tfops/ are tested (e.g. a `git archive HEAD` copy)")
    parser.add_argument("--log", type=Path, help="write every failing test's output tail here")
    parser.add_argument("--no-gpu", action="store_true",
                        help="do not launch tests named *_gpu* (they skip without a GPU): counted as 'gpu'")
    args = parser.parse_args(argv)
    if args.elastic:
        return _run_elastic(args)
    if not args.test_file:
        parser.error("give a test file (a name such as test_tensorflow.py, or a path), or --elastic")
    given = Path(args.test_file)
    source_file = given if given.exists() else _test_dir(args) / "parallel" / given.name
    if not source_file.exists():
        raise SystemExit(f"{source_file} does not exist")
    work, test_file = make_alias_dir(source_file.resolve(), args.keras3, args.source.resolve())
    env = environment(work, args.extra_path, args.source.resolve())
    ids = [t for t in collect(test_file, env) if any(k in t for k in args.k.split(","))]
    standin = "; horovod.tensorflow.util -> stand-in" if (work / "tfops_util_standin.py").exists() else ""
    origin = source_file if given.exists() else f"Horovod {args.tag} test/parallel/{given.name}"
    print(f"# {' '.join(sys.argv)}\n# {len(ids)} tests from {origin}, mpirun -np {args.np_}, "
          f"timeout {args.timeout:g} s, {args.chunk} per mpirun, source {args.source}{standin}", flush=True)
    results = {}
    if args.no_gpu:
        for t in [t for t in ids if "gpu" in t.split("::")[-1]]:
            results[t] = ("gpu", "not launched: a GPU test (--no-gpu)")
            ids.remove(t)
    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), max(1, args.chunk))]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_chunk, c, test_file, args.np_, args.timeout, env) for c in chunks]
        for fut in concurrent.futures.as_completed(futures):
            for test_id, verdict, tail, seconds in fut.result():
                results[test_id] = (verdict, tail)
                print(f"{verdict:5s} {seconds:6.1f}s  {test_id.split('::')[-1]}", flush=True)
    counts = {v: sum(1 for r, _ in results.values() if r == v)
              for v in ("pass", "tf1", "fail", "skip", "hang", "gpu")}
    print(f"# {given.name} -np {args.np_}: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if args.log:
        with args.log.open("w") as f:
            for test_id, (verdict, tail) in sorted(results.items()):
                if verdict in ("fail", "hang", "tf1"):
                    f.write(f"===== {verdict} {test_id}\n{tail}\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
