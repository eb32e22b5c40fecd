"""allreduce-plan's predictions held against a real run of the project's GPT (examples/gpt.py).

One launch at -np 2 (benchmarks/plan_bench.py's worker) trains the example at ZeRO 0 (data 2), ZeRO 2
(tfops.ShardedOptimizer over the data set) and tensor 2, each for one step after its trace, and
counts what the run holds: weights and optimizer state from the live variables, activations from
the traced step's graph (the forward tensors the backward pass reads). Each count must be within
15% of the planner's prediction for the same layout (issue 44), except tensor 2's activations,
which the split layers keep more of than the planner counts (a known gap). The step-time
ordering is not held here: the planner does not get it right on this machine (BENCHMARKS.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .harness import TF_ENV, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
TIMEOUT = 600                 # one launch of 2 TF ranks and three models; minutes on a loaded 2-core VM
CONFIGS = "t1z0,t1z2,t2z0"
SHAPE = ("--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "8", "--steps", "1")


@pytest.mark.mpi
@pytest.mark.timeout(TIMEOUT + 30)
def test_plan_predicts_a_real_run():
    pytest.importorskip("tensorflow")
    import plan_bench
    out = mpirun(2, ROOT / "benchmarks" / "plan_bench.py", "--worker", "--configs", CONFIGS, *SHAPE,
                 timeout=TIMEOUT, env={**TF_ENV, **plan_bench.FIXED_MMAP, "ALLREDUCE_TIMEOUT": "600"}).stdout
    rows = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert sorted({r["config"] for r in rows}) == sorted(CONFIGS.split(",")) and len(rows) == 6, out[-2000:]
    for row in rows:
        pred = plan_bench.predict(row)
        where = f"{row['config']} rank {row['rank']}"
        # tensor parallelism's activations are not held: the split layers keep more than the planner
        # counts (+39% at tensor 2 here; BENCHMARKS.md), a gap left open
        for key in ("weights", "state") + (("activations",) if row["tensor"] == 1 else ()):
            assert row[key] == pytest.approx(pred[key], rel=0.15), \
                f"{where}: {key} counted {row[key]} B, predicted {pred[key]:.0f} B"
    # the counts follow the layout: ZeRO 2 halves the optimizer state, tensor 2 halves the weights
    by = {(r["config"], r["rank"]): r for r in rows}
    assert by["t1z2", 0]["state"] < 0.8 * by["t1z0", 0]["state"]
    assert by["t2z0", 0]["weights"] < 0.8 * by["t1z0", 0]["weights"]
