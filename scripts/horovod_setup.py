"""Where Horovod's tests run (scripts/horovod_tests.py): their files, a module alias, Keras 3 spellings.

* :func:`extract`: Horovod's ``test/`` at a git tag (``git archive`` of a bare clone);
* :func:`make_alias_dir`: a temporary directory with a ``horovod`` package whose
  ``horovod.tensorflow[.X]`` is ``tfops[.X]`` (the same module objects), the
  test file copied there (``--keras3``: with :data:`KERAS3_SPELLINGS` applied), and
  the one runner helper the test utilities import (``horovod/runner/util/threads.py``,
  Horovod's own file from the same tag);
* :func:`environment`: that directory first on ``PYTHONPATH``, one thread per op.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ROOT", "HOROVOD_GIT", "TAG", "KERAS3_SPELLINGS", "extract", "make_alias_dir", "environment",
           "kill_tagged"]

ROOT = Path(__file__).resolve().parent.parent
HOROVOD_GIT = Path("/work/.mirror/horovod+horovod/repo")     #: where the search tool's fetch puts horovod/horovod
TAG = "v0.28.1"

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
    (r"optimizer\.lr\.assign\(", "optimizer.learning_rate.assign(", "Keras 3 optimizers have no .lr (elastic worker)"),
    (r"keras\.layers\.ThresholdedReLU\(0\.5\)", "keras.layers.ReLU(threshold=0.5)",
     "ThresholdedReLU was removed in Keras 3"),
    (r",\s*input_length=10", "", "Embedding lost input_length"),
    (r"keras\.losses\.mean_squared_error\b", "keras.losses.mse", "tf.keras.losses lost the long function name"),
    (r"BatchNormalization\(axis=1, fused=False\)", "BatchNormalization(axis=1)",
     "Keras 3's BatchNormalization has no fused= (it chooses its kernel itself)"),
    (r"\b(bn|sync_bn)\.apply\(", r"\1(", "Keras 3 layers have no Layer.apply, Keras 2's alias of calling the layer"),
    (r"def update_step\(self, gradient, variable\):", "def update_step(self, gradient, variable, learning_rate=None):",
     "Keras 3 calls update_step(gradient, variable, learning_rate) (0.28.1's TestingOptimizer: Keras 2.11's API)"),
    (r"super\(\)\.__init__\(name=name, \*\*kwargs\)", "super().__init__(learning_rate=0.1, name=name, **kwargs)",
     "Keras 3's Optimizer takes learning_rate (Keras 2.11 built it in _build_learning_rate(0.1))"),
    (r"(?<![\w.])(\w+)\.ref\(\)", r"id(\1)",
     "Keras 3 variables have no Variable.ref() (a tf.Variable method); id() keys the same objects"),
]

# Horovod's own pure-Python helpers that its test utilities import (test/utils/common.py: in_thread),
# taken from the same tag and put into the alias package as they are.
# test_tensorflow_process_sets.py reads the world size as Horovod's launcher does (runner/common/util/env.py:
# get_env_rank_and_size, which imports secret.py).
_RUNNER_FILES = ("horovod/runner/util/threads.py", "horovod/runner/common/util/env.py",
                 "horovod/runner/common/util/secret.py")


def extract(git_dir: Path, tag: str) -> Path:
    """Horovod's ``test/`` directory at ``tag``, extracted into a temporary directory; returns it."""
    out = Path(tempfile.mkdtemp(prefix=f"horovod-{tag}-"))
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "--format=tar", tag, "test/parallel",
                              "test/utils", "test/integration", *_RUNNER_FILES], capture_output=True, timeout=300)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {tag} from {git_dir} failed: {archive.stderr.decode()[-500:]} "
                         "(fetch horovod/horovod first, or pass a test file's path)")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True, timeout=300)
    return out / "test"


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
    for name in _RUNNER_FILES:
        found = [parent / name for parent in test_file.parents if (parent / name).exists()]
        if found:
            target = work / name
            target.parent.mkdir(parents=True, exist_ok=True)
            for package in target.relative_to(work).parents:     # every package down to it, horovod/ excepted
                if package != Path(".") and package != Path("horovod"):
                    (work / package / "__init__.py").touch()
            shutil.copy(found[0], target)
    tests = work / "parallel"
    tests.mkdir()
    # the test file and the base classes beside it (0.28.1: base_test_tensorflow.py)
    for path in [test_file, *sorted(test_file.parent.glob("base_test_*.py"))]:
        text = path.read_text()
        if keras3:
            for pattern, replacement, _ in KERAS3_SPELLINGS:
                text = re.sub(pattern, replacement, text)
        (tests / path.name).write_text(text)
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


def kill_tagged(tag: str) -> None:
    """SIGKILL the ranks of a hung job: mpirun starts them in sessions of their own (as tests/harness.py)."""
    needle = f"HVDTESTS_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


