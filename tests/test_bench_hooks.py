"""benchmarks/hooks_bench.py, hooks_section.py and the peers hooks line (issue 32), on made-up and tiny runs."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import hooks_section, resnet50_shapes
from benchmarks.peers import verdict
from tests.harness import ROOT, mpirun


def test_keras_resnet50_shapes_are_keras_applications_trainable_set():
    # keras.applications.ResNet50(weights=None): 214 trainable tensors, 25,583,592 values
    # (the 25,636,712 parameters less batch norm's 53,120 moving statistics).
    shapes = resnet50_shapes.keras_shapes()
    assert len(shapes) == 214 and sum(math.prod(s) for _, s in shapes) == 25_583_592
    assert dict(shapes)["conv1.weight"] == (7, 7, 3, 64) and dict(shapes)["fc.weight"] == (2048, 1000)


def _powersgd_bytes(shapes, rank: int) -> int:
    """What PowerSGD sends per step by its own rule (an independent count): (rows + cols) r floats
    per compressed matrix, every other tensor whole."""
    total = 0
    for shape in shapes:
        rows, cols = math.prod(shape[:-1]), shape[-1]
        r = min(rank, rows, cols)
        total += (rows + cols) * r if (rows + cols) * r * 2 < rows * cols else rows * cols
    return 4 * total


@pytest.mark.mpi
def test_hooks_bench_counts_what_each_hook_hands_to_its_collectives(tmp_path):
    out = tmp_path / "b.json"
    mpirun(2, ROOT / "benchmarks" / "hooks_bench.py", "--scale", "0.05", "--steps", "1", "--warmup", "0",
           "--json", str(out), timeout=120)
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    shapes = [s[:-1] + (max(1, round(s[-1] * 0.05)),) for _, s in resnet50_shapes.keras_shapes()]
    n = sum(math.prod(s) for s in shapes)
    assert data["elements"] == n and rows["fp32"]["payload"] == 4 * n and rows["fp16"]["payload"] == 2 * n
    for r in (1, 2, 4):
        assert rows[f"powersgd{r}"]["payload"] == _powersgd_bytes(shapes, r), r
    # 1 bit: at p = 2 half of each tensor's signs go to the other rank and the owner's half comes
    # back, n/8 bytes, plus a float64 scale per chunk each way
    assert n / 8 <= rows["onebit"]["payload"] <= n / 8 + 2 * 8 * len(shapes) + 2 * len(shapes)
    assert all(r["host_tx"] is None and r["exchange_ms"] > 0 for r in rows.values())      # one node: no link


def _bench(rates: dict, hook_ms: float) -> dict:
    return {"rows": [{"method": m, "payload": b, "host_tx": b * 1.01, "exchange_ms": t,
                      "hook_ms": hook_ms if m.startswith("powersgd") or m == "onebit" else 0.0}
                     for m, (b, t) in rates.items()]}


def test_section_goals_are_ratios_of_one_run():
    bench = _bench({"fp32": (100e6, 800.0), "fp16": (50e6, 400.0), "powersgd4": (1.6e6, 40.0),
                    "onebit": (3.2e6, 500.0)}, 30.0)
    train = {"runs": [{"method": "fp32", "step_ms": 100.0, "evals": [(10, 1.0, 0.5), (20, 2.0, 0.95)]},
                      {"method": "fp16", "step_ms": 60.0, "evals": [(10, 0.6, 0.6), (20, 1.2, 0.95)]},
                      {"method": "powersgd4", "step_ms": 20.0, "evals": [(10, 0.2, 0.94), (20, 0.4, 0.95)]},
                      {"method": "compute", "step_ms": 10.0, "evals": []}]}
    lines = hooks_section.goals({"bench_2x1": bench, "bench_2x2": bench, "bench_one_node": bench,
                                 "bench_small_2x1": bench, "train_2x1": train})
    text = "\n".join(lines)
    assert "fp32 / PowerSGD rank 4 (ResNet-50): 62.5x" in text and "(goal >= 50x): met" in text
    assert "fp16 / PowerSGD rank 4: 10.00x (goal >= 8x): met" in text
    assert "the exchange is 90% of an fp32 step" in text and "0.17x (goal <= 0.3x): met" in text


def test_peers_hooks_line_names_horovods_compressors():
    saved = verdict.hooks_goal({"versions": {"horovod": {"horovod": "0.28.1"}}})
    assert "ours runs PowerSGD and OneBit" in saved and "Horovod 0.28.1 cannot run either hook" in saved
    assert "fp16, none (horovod/tensorflow/compression.py of 0.28.1" in saved
    recorded = verdict.hooks_goal({"versions": {"horovod": {"horovod": "0.28.1", "compressors": ["fp16", "none"]}}})
    assert "recorded by horovod_bench.py" in recorded
