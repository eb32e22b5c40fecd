"""The model-parallel rank scripts (issues 33, 42, 43, 44), several to a launch: one launch per world size.

Each check was a launch of its own (sharding at 2, 3 and 4 processes, stage 3 at 3 and 4, recompute
at 2, tensor parallelism at 2 and 4, the pipeline at 2 and 4: eleven launches, 29 TensorFlow
processes). Importing TensorFlow, Keras and tfops costs about 5 CPU-seconds a process, so the
scripts of one world size now run one after the other in the same processes
(tests/mpi/tf_in_turn.py), three launches and 9 processes in all, and each script is still a test of
its own here, passed or failed by the marker its ranks print. The scripts' docstrings list their checks:

- tests/mpi/sharding_check.py: tfops.ShardedOptimizer, stages 1 and 2, equal to DistributedOptimizer;
  each size loads the checkpoints the previous size wrote (another rank count);
- stage3_check.py: fully_shard + ShardedOptimizer(stage=3), equal to DistributedOptimizer, with
  recompute and with tensor parallelism (-np 4); 4 loads what 3 wrote;
- recompute_check.py: keras.RematScope / keras.remat / selective_recompute with every distributed
  path (stage 3 at -np 2 among them): same gradients, each reduced once;
- tensor_check.py: the tensor-parallel layers and the GPT at tensor 2 (-np 2), tensor 4 and
  tensor 2 x data 2 (-np 4), tensor 4's checkpoint loaded at tensor 2;
- pipeline_check.py: every schedule, at every m, with each optimizer, against the one-process model.

The launches run in size order on one worker (xdist's loadfile: a file to a worker), because 3 and 4
load files the smaller size wrote; a test run alone first runs the launches it needs. A script that
raises ends its launch: its test fails with the launch's output, and every later script of that
launch fails naming it. The -np 8 3D pipeline check is tests/test_pipeline.py's.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from .harness import TF_ENV, check_in_turn, launch_in_turn

pytest.importorskip("tensorflow")

PER_SCRIPT = 600          # seconds a script may take on a loaded 2-core machine (TF's import included)


def _runs(size: int, out: Path) -> list[tuple[str, ...]]:
    prev = {3: 2, 4: 3}.get(size)
    runs = {
        2: [("sharding_check", f"{out}/sharding2"), ("recompute_check",), ("tensor_check",),
            ("pipeline_check", f"{out}/pipeline2")],
        3: [("sharding_check", f"{out}/sharding3", f"{out}/sharding{prev}"), ("stage3_check", f"{out}/stage3_3")],
        4: [("sharding_check", f"{out}/sharding4", f"{out}/sharding{prev}"),
            ("stage3_check", f"{out}/stage3_4", f"{out}/stage3_3"), ("tensor_check",),
            ("pipeline_check", f"{out}/pipeline4")],
    }[size]
    for _, *args in runs:
        if args:
            Path(args[0]).mkdir(exist_ok=True)       # the folder this run writes into
    return runs


_outputs: dict[int, str] = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel_scripts")


def _launch(size: int, out: Path) -> str:
    """The output of ``size``'s launch, after the smaller sizes' launches whose files it loads."""
    if size not in _outputs:
        for before in [s for s in (2, 3) if s < size]:
            _launch(before, out)
        _outputs[size] = launch_in_turn(size, _runs(size, out), per_script=PER_SCRIPT, env=TF_ENV)
    return _outputs[size]


LOADED = {"sharding_check": "loaded the files of another rank count (keras and tf.train.Checkpoint",
          "stage3_check": "loaded the files of another rank count (fully sharded and plain)"}
MESHES = {2: ["tensor=2, data=1"], 4: ["tensor=4, data=1", "tensor=2, data=2"]}
CASES = [(2, "sharding_check"), (2, "recompute_check"), (2, "tensor_check"), (2, "pipeline_check"),
         (3, "sharding_check"), (3, "stage3_check"),
         (4, "sharding_check"), (4, "stage3_check"), (4, "tensor_check"), (4, "pipeline_check")]


@pytest.mark.mpi
@pytest.mark.timeout(PER_SCRIPT * 10 + 60)        # a test run alone may run three launches first
@pytest.mark.parametrize("size, script", [pytest.param(s, n, id=f"np{s}-{n}") for s, n in CASES])
def test_parallel_script(size, script, folder):
    out = _launch(size, folder)
    check_in_turn(out, size, script)
    if script in LOADED and size > {"sharding_check": 2, "stage3_check": 3}[script]:
        assert f"rank 0: {LOADED[script]}" in out, f"{script} at {size}: no load of another rank count\n{out[-3000:]}"
    if script == "tensor_check":
        done = "regions, layers, per-rank init, model.fit, bad input, gpt, counts, memory, checkpoint"
        for mesh in MESHES[size]:
            assert f"Mesh({mesh}, pipeline=1; this rank: tensor_rank=0, data_rank=0, pipeline_rank=0): {done}: OK" \
                in out, out[-3000:]
