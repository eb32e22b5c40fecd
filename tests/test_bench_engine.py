"""benchmarks/engine_bench.py on 2 ranks (tiny), and the ResNet-50 shape list it uses."""
from __future__ import annotations

import json
import math

import pytest

import allreduce as ar
from benchmarks import resnet50_shapes
from tests.harness import ROOT, mpirun

BENCH = ROOT / "benchmarks" / "engine_bench.py"


def test_resnet50_shapes_match_the_published_model():
    # torchvision resnet50: 161 parameter tensors, 25,557,032 parameters.
    assert len(resnet50_shapes.SHAPES) == 161
    assert resnet50_shapes.TOTAL == 25_557_032
    names = [n for n, _ in resnet50_shapes.SHAPES]
    assert len(set(names)) == len(names)
    shapes = dict(resnet50_shapes.SHAPES)
    assert shapes["layer4.2.conv3.weight"] == (2048, 512, 1, 1) and shapes["fc.weight"] == (1000, 2048)
    assert sum(math.prod(s) for n, s in resnet50_shapes.SHAPES if "conv" in n or "downsample.0" in n) == 23_454_912
    assert resnet50_shapes.shapes(num_classes=10)[-1] == ("fc.bias", (10,))


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(ar, "allreduce_async"), reason="the engine API is not in this tree")
def test_engine_bench_smoke(tmp_path):
    out = tmp_path / "engine.json"
    proc = mpirun(2, BENCH, "-n", "1", "-w", "1", "--tensors", "20", "--compress-sizes", "64K",
                  "--modes", "fusion,compression,latency", "--json", str(out), timeout=180)
    data = json.loads(out.read_text())
    got = {(r["mode"], r["algorithm"]): r for r in data["records"]}
    assert {("fusion", "engine"), ("fusion", "unfused-blocking"), ("compression", "none"), ("compression", "fp16"),
            ("compression", "bf16"), ("latency", "engine-roundtrip"), ("latency", "blocking")} <= set(got)
    assert got[("fusion", "engine")]["size_bytes"] == 20 * 4096
    # Errors against the exact float64 mean: float32 rounding only, then fp16 (11 bits), bf16 (8 bits).
    assert got[("compression", "none")]["max_rel_err"] < 1e-6
    assert got[("compression", "fp16")]["max_rel_err"] < 2e-3
    assert got[("compression", "bf16")]["max_rel_err"] < 2e-2
    assert "# fusion: engine / unfused-blocking time = " in proc.stdout
    assert data["command"].startswith("allreduce-run -np 2")
