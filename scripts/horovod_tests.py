"""Run Horovod's own TensorFlow test files against tfops: the yardstick of issue 27.

::

    python scripts/horovod_tests.py /tmp/hvdtests/parallel/test_tensorflow.py --np 2
    python scripts/horovod_tests.py /tmp/hvdtests/parallel/test_tensorflow2_keras.py --np 2 --keras3

Horovod's test files are not part of this repository (get them from Horovod's
``test/parallel/`` and ``test/utils/common.py``). Every test runs in its own
``mpirun -np N python -m pytest FILE::CLASS::TEST`` under a timeout, so one
failing or hanging test cannot take the others with it; the table prints
pass / fail / skip / hang per test, then the counts.

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
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ALIAS = '''"""Alias package for Horovod's tests: horovod.tensorflow -> tfops (see scripts/horovod_tests.py)."""
import importlib
import importlib.abc
import importlib.util
import sys

_MAP = (("horovod.tensorflow.keras", "tfops.keras"), ("horovod.tensorflow", "tfops"),
        ("horovod.keras", "tfops.keras"))
if importlib.util.find_spec("tfops.util") is None:
    _MAP = (("horovod.tensorflow.util", "tfops_util_standin"),) + _MAP


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        for old, new in _MAP:
            if fullname == old or fullname.startswith(old + "."):
                return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        for old, new in _MAP:
            if spec.name == old or spec.name.startswith(old + "."):
                module = importlib.import_module(new + spec.name[len(old):])
                self._spec = module.__spec__
                return module

    def exec_module(self, module):
        module.__spec__ = self._spec       # importlib overwrote it with the alias's spec


sys.meta_path.insert(0, _Alias())
'''

# horovod.tensorflow.util is a Horovod internal that test_tensorflow.py imports (_executing_eagerly);
# used only where tfops has no util module of its own.
_UTIL_STANDIN = '''"""Stand-in for the internal horovod.tensorflow.util (scripts/horovod_tests.py): tfops has no util module."""
import tensorflow as tf


def _executing_eagerly():
    return tf.executing_eagerly()
'''

_COMMON_UTIL = '''from packaging import version


def is_version_greater_equal_than(ver, target):
    return version.parse(ver) >= version.parse(target)
'''

_K3COMPAT = '''"""Keras 3 stand-ins for Keras 2 names Horovod's Keras test file uses (scripts/horovod_tests.py --keras3)."""
import keras


class _OptimizerV2(keras.optimizers.Optimizer):
    """A Keras 2 OptimizerV2 subclass's ``_resource_apply_dense(grad, var)`` as a Keras 3 ``update_step``."""

    def __init__(self, name="OptimizerV2", **kwargs):
        super().__init__(learning_rate=kwargs.pop("learning_rate", 0.0), name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        self._resource_apply_dense(gradient, variable)


class optimizer_v2:
    OptimizerV2 = _OptimizerV2
'''

# (pattern, replacement, why): Keras 2 spellings that Keras 3 removed.
KERAS3_SPELLINGS = [
    (r"from keras\.optimizers\.legacy import optimizer_v2", "from hvd_k3compat import optimizer_v2",
     "Keras 3 has no optimizer_v2; OptimizerV2._resource_apply_dense becomes a Keras 3 update_step"),
    (r"from keras\.optimizers\.legacy import Optimizer", "from keras import optimizers as Optimizer",
     "the file calls Optimizer.Adam(...): the optimizers module"),
    (r"(tf\.)?keras\.optimizers\.legacy\.", r"\1keras.optimizers.",
     "keras.optimizers.legacy.* raise ImportError in Keras 3: the Keras 3 optimizers"),
    (r"\blr=", "learning_rate=", "Keras 3 optimizers take learning_rate="),
    (r",\s*experimental_run_tf_function=False", "", "compile() lost experimental_run_tf_function"),
    (r"\.lr\.numpy\(\)", ".learning_rate.numpy()", "Keras 3 optimizers have no .lr"),
    (r"keras\.layers\.ThresholdedReLU\(0\.5\)", "keras.layers.ReLU(threshold=0.5)",
     "ThresholdedReLU was removed in Keras 3"),
    (r",\s*input_length=10", "", "Embedding lost input_length"),
    (r"keras\.losses\.mean_squared_error\b", "keras.losses.mse", "tf.keras.losses lost the long function name"),
    (r"BatchNormalization\(axis=1, fused=False\)", "BatchNormalization(axis=1)",
     "Keras 3's BatchNormalization has no fused= (it chooses its kernel itself)"),
    (r"\b(bn|sync_bn)\.apply\(", r"\1(", "Keras 3 layers have no Layer.apply, Keras 2's alias of calling the layer"),
    (r"(?<![\w.])(\w+)\.ref\(\)", r"id(\1)",
     "Keras 3 variables have no Variable.ref() (a tf.Variable method); id() keys the same objects"),
]

_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?)")
_SUBTESTS_PASSED = re.compile(r"(\d+) subtests passed")
_SUBFAILED = re.compile(r"SUBFAILED\[(\w+)\]")      # in the -rf summary: which half of a test failed


def make_alias_dir(test_file: Path, keras3: bool, source: Path) -> tuple[Path, Path]:
    """A temporary directory holding the alias package and a copy of the test file; returns both."""
    work = Path(tempfile.mkdtemp(prefix="hvdtests-"))
    (work / "horovod" / "common").mkdir(parents=True)
    (work / "horovod" / "__init__.py").write_text(_ALIAS)
    (work / "horovod" / "common" / "__init__.py").write_text("")
    (work / "horovod" / "common" / "util.py").write_text(_COMMON_UTIL)
    (work / "hvd_k3compat.py").write_text(_K3COMPAT)
    if not (source / "tfops" / "util.py").exists():
        (work / "tfops_util_standin.py").write_text(_UTIL_STANDIN)
    tests = work / "parallel"
    tests.mkdir()
    source = test_file.read_text()
    if keras3:
        for pattern, replacement, _ in KERAS3_SPELLINGS:
            source = re.sub(pattern, replacement, source)
    (tests / test_file.name).write_text(source)
    utils = test_file.parent.parent / "utils"
    if utils.is_dir():
        shutil.copytree(utils, work / "utils")
    return work, tests / test_file.name


def environment(work: Path, extra_path: list[str], source: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work), *extra_path, str(source), env.get("PYTHONPATH", "")])
    env.update(TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1")
    return env


def collect(test_file: Path, env: dict) -> list[str]:
    """Test ids (``file::Class::test``), one process, no mpirun."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(test_file)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=test_file.parent)
    ids = [line.strip() for line in proc.stdout.splitlines() if line.startswith(test_file.name + "::")]
    if not ids:
        raise SystemExit(f"collected no tests from {test_file}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return ids


def _kill_tagged(tag: str) -> None:
    """SIGKILL the ranks of a hung job: mpirun starts them in sessions of their own (as tests/harness.py)."""
    needle = f"HVDTESTS_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def run_one(test_id: str, test_file: Path, np_: int, timeout: float, env: dict) -> tuple[str, str, float]:
    """One mpirun for one test; returns (verdict, the last lines of output, seconds)."""
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "pytest",
           "-q", "-x", "-p", "no:cacheprovider", "-rfEs", test_id]
    env = dict(env, HVDTESTS_TAG=uuid.uuid4().hex)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=test_file.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_tagged(env["HVDTESTS_TAG"])
        out, _ = proc.communicate()
        return "hang", out[-1500:], time.monotonic() - start
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for n, kind in _SUMMARY.findall(out):
        counts["error" if kind.startswith("error") else kind] += int(n)
    failed_modes = set(_SUBFAILED.findall(out))
    eager_passed = sum(int(n) for n in _SUBTESTS_PASSED.findall(out)) >= np_
    if counts["failed"] and failed_modes == {"graph_mode"} and eager_passed and not counts["error"]:
        verdict = "tf1"            # the eager half passes; only the TF1-session (graph mode) half fails
    elif counts["failed"] or counts["error"] or proc.returncode not in (0,) and not counts["skipped"]:
        verdict = "fail"
    elif counts["passed"] >= np_:
        verdict = "pass"
    elif counts["skipped"]:
        verdict = "skip"
    else:
        verdict = "fail"
    return verdict, out[-1500:], time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("test_file", type=Path)
    parser.add_argument("--np", type=int, default=2, dest="np_")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per test (then: hang)")
    parser.add_argument("--jobs", type=int, default=1, help="tests run at the same time")
    parser.add_argument("-k", default="", help="only test ids containing this")
    parser.add_argument("--keras3", action="store_true", help="apply KERAS3_SPELLINGS to the copy")
    parser.add_argument("--extra-path", action="append", default=[], help="test-only packages dir")
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="the tree whose allreduce/ and tfops/ are tested (e.g. a `git archive HEAD` copy)")
    parser.add_argument("--log", type=Path, help="write every failing test's output tail here")
    parser.add_argument("--no-gpu", action="store_true",
                        help="do not launch tests named *_gpu* (they skip without a GPU): counted as 'gpu'")
    args = parser.parse_args(argv)

    work, test_file = make_alias_dir(args.test_file.resolve(), args.keras3, args.source.resolve())
    env = environment(work, args.extra_path, args.source.resolve())
    ids = [t for t in collect(test_file, env) if args.k in t]
    standin = "; horovod.tensorflow.util -> stand-in" if (work / "tfops_util_standin.py").exists() else ""
    print(f"# {' '.join(sys.argv)}\n# {len(ids)} tests from {args.test_file}, mpirun -np {args.np_}, "
          f"timeout {args.timeout:g} s, source {args.source}{standin}", flush=True)
    results = {}
    if args.no_gpu:
        for t in [t for t in ids if "gpu" in t.split("::")[-1]]:
            results[t] = ("gpu", "not launched: a GPU test (--no-gpu)")
            ids.remove(t)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_one, t, test_file, args.np_, args.timeout, env): t for t in ids}
        for fut in concurrent.futures.as_completed(futures):
            test_id = futures[fut]
            verdict, tail, seconds = fut.result()
            results[test_id] = (verdict, tail)
            print(f"{verdict:5s} {seconds:6.1f}s  {test_id.split('::')[-1]}", flush=True)
    counts = {v: sum(1 for r, _ in results.values() if r == v)
              for v in ("pass", "tf1", "fail", "skip", "hang", "gpu")}
    print(f"# {args.test_file.name} -np {args.np_}: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if args.log:
        with args.log.open("w") as f:
            for test_id, (verdict, tail) in sorted(results.items()):
                if verdict in ("fail", "hang", "tf1"):
                    f.write(f"===== {verdict} {test_id}\n{tail}\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
