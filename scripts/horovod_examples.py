"""Run Horovod's ``examples/tensorflow2`` scripts against tfops: the second half of issue 27's yardstick.

::

    python scripts/horovod_examples.py /tmp/hvdexamples/tensorflow2_*.py --np 2 --timeout 300 --synthetic-mnist

Horovod's examples are not part of this repository (get them from Horovod's
``examples/tensorflow2/``). Each one runs unchanged apart from the import, through the
same module alias as :mod:`horovod_tests` (:mod:`horovod_setup`) (``horovod.tensorflow`` is ``tfops``), plus the
Keras 3 spellings in ``EXAMPLE_SPELLINGS`` that real Horovod under Keras 3 would need as
well. One ``mpirun -np N`` per example, under ``--timeout``.

The MNIST examples download ``mnist.npz`` from storage.googleapis.com. Where that cannot
be reached (this VM), ``--synthetic-mnist`` puts a ``sitecustomize`` first on the path that
replaces ``keras.datasets.mnist.load_data`` with arrays of MNIST's shapes and dtypes (each
class a fixed pattern plus noise, so the loss visibly falls). The examples train for
thousands of steps (``tensorflow2_mnist.py``: 10000 / size; the Keras one: 24 epochs of
500 / size), which takes far longer than a check should on two cores, so a run that is
still training at ``--timeout`` is reported as ``ran`` with the last progress line it
printed (step number and loss, or the epoch) rather than ``pass``.

Verdicts: ``pass`` (exit 0), ``ran`` (training, progress shown, stopped at the timeout),
``fail`` (a non-zero exit, or no progress by the timeout).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from horovod_setup import KERAS3_SPELLINGS, ROOT, environment, make_alias_dir, kill_tagged as _kill_tagged  # noqa: E402

# (pattern, replacement, why): Keras 2 spellings in Horovod's examples that Keras 3 removed.
EXAMPLE_SPELLINGS = [
    (r"\bopt\.variables\(\)", "opt.variables", "Keras 3 optimizers' variables is a property, not a method"),
    (r"(checkpoint-\{epoch\})\.h5'", r"\1.keras'",
     "Keras 3's ModelCheckpoint saves whole models only as .keras (.h5 raises at construction)"),
]

_SYNTHETIC_MNIST = '''"""--synthetic-mnist (scripts/horovod_examples.py): keras.datasets.mnist.load_data without a download."""
import importlib.abc
import importlib.util
import sys

_TARGET = "keras.src.datasets.mnist"


def load_data(path="mnist.npz"):
    import numpy as np
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 256, size=(10, 28, 28)).astype(np.float32)

    def split(n):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        noise = rng.normal(0, 40, size=(n, 28, 28)).astype(np.float32)
        images = np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8)
        return images, labels
    return split(60000), split(10000)


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.load_data = load_data
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
'''

_PROGRESS = re.compile(r"(Step #\d+\s+Loss: [-\d.enaif]+|Epoch \d+/\d+|Iter #\d+: [\d.]+ img/sec per \w+"
                       r"|Img/sec per \w+: [\d.]+ \+-[\d.]+)")


def run_example(example: Path, np_: int, timeout: float, env: dict, args: list[str]) -> tuple[str, str, float]:
    """One mpirun for one example; returns (verdict, last progress line or output tail, seconds)."""
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable, str(example), *args]
    env = dict(env, HVDTESTS_TAG=uuid.uuid4().hex)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=example.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_tagged(env["HVDTESTS_TAG"])
        out, _ = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    progress = _PROGRESS.findall(out)
    if not timed_out:
        return ("pass" if proc.returncode == 0 else "fail"), (progress[-1] if progress and proc.returncode == 0
                                                               else out[-2000:]), seconds
    if progress and "Traceback" not in out:
        return "ran", f"{len(progress)} progress lines, the last: {progress[-1]}", seconds
    return "fail", out[-2000:], seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("examples", type=Path, nargs="+")
    parser.add_argument("--np", type=int, default=2, dest="np_")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per example")
    parser.add_argument("--synthetic-mnist", action="store_true",
                        help="replace keras.datasets.mnist.load_data (no download) with MNIST-shaped arrays")
    parser.add_argument("--args", default="",
                        help="the examples' own command-line options, e.g. '--model MobileNetV2 --num-iters 2' "
                             "(ResNet-50, the synthetic benchmarks' default, runs ~3 images/s on 2 cores)")
    parser.add_argument("--source", type=Path, default=ROOT, help="the tree whose tfops is run")
    args = parser.parse_args(argv)
    print(f"# {' '.join(sys.argv)}", flush=True)
    counts = {"pass": 0, "ran": 0, "fail": 0}
    for example in args.examples:
        work, copy = make_alias_dir(example.resolve(), True, args.source.resolve())
        source = copy.read_text()
        for pattern, replacement, _ in EXAMPLE_SPELLINGS:
            source = re.sub(pattern, replacement, source)
        copy.write_text(source)
        if args.synthetic_mnist:
            (work / "sitecustomize.py").write_text(_SYNTHETIC_MNIST)
        env = environment(work, [], args.source.resolve())
        verdict, detail, seconds = run_example(copy, args.np_, args.timeout, env, shlex.split(args.args))
        counts[verdict] += 1
        print(f"{verdict:4s} {seconds:6.1f}s  {example.name}: {detail}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"# examples -np {args.np_}: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return 0 if not counts["fail"] else 1


if __name__ == "__main__":
    sys.exit(main())
