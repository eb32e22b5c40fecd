"""examples/large_batch.py (lesson 15's lab) runs end to end at -np 2 in its --tiny configuration.

Every method trains at two global batches (one epoch) through tfops.DistributedOptimizer; the table must hold
every cell, the step counts must follow from the batch, the small-batch runs must have learnt
(accuracy far above the 10% of guessing), and the plot must be a PNG.
"""
from __future__ import annotations

import re

from .harness import ROOT, TF_ENV, mpirun

METHODS = ["sgd", "linear", "warmup", "lars", "lamb"]


def test_lab_runs_tiny_at_np2(tmp_path):
    png = tmp_path / "large-batch.png"
    out = mpirun(2, ROOT / "examples" / "large_batch.py", "--tiny", "--plot", str(png), timeout=240,
                 env=TF_ENV).stdout
    header = next(line for line in out.splitlines() if line.split()[:2] == ["global", "batch"])
    assert header.split()[3:] == METHODS, out
    rows = {int(m.group(1)): (int(m.group(2)), [float(a) for a in m.group(3).split()])
            for m in re.finditer(r"^\s+(\d+)\s+(\d+)\s+((?:[01]\.\d{3}\s*){5})$", out, re.M)}
    assert sorted(rows) == [16, 512], out
    for batch, (steps, accuracies) in rows.items():
        # 1436 samples in two shards of 718; each rank takes batch/2 a step, 1 epoch
        assert steps == 718 // (batch // 2), (batch, steps)
        assert all(0.0 <= a <= 1.0 for a in accuracies)
    assert min(rows[16][1]) > 0.5, f"a small-batch run did not learn: {rows[16]}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
