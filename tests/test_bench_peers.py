"""The peer comparison (benchmarks/peers/): its timing, table, goal lines and report section.

The table and verdict code runs on made-up rows (no peer needed). Two launches check the
runners themselves, each skipped with its reason where its peer is absent: Gloo needs torch
(the [bench] extra), Horovod needs .venv-horovod (benchmarks/peers/build_horovod.sh);
CI installs neither, so there only the pure checks run.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from benchmarks.goals import goals_section
from benchmarks.peers import section, timing, verdict
from tests.harness import ROOT, kill_tagged, mpi_env


def _rows(times: dict[tuple[str, str, int], float]) -> list[dict]:
    return [timing.record(m, impl, n, 1000 if m == "grouped" else 1, t * 1e-6, 2) for (m, impl, n), t in times.items()]


def test_record_best_of_and_table():
    r = timing.record("busbw", "gloo", 1 << 20, 1, 1e-3, 2)
    assert r["algbw_gbps"] == pytest.approx((1 << 20) / 1e-3 / 1e9) and r["busbw_gbps"] == r["algbw_gbps"]
    assert timing.record("busbw", "gloo", 1 << 20, 1, 1e-3, 4)["busbw_gbps"] == pytest.approx(1.5 * r["algbw_gbps"])
    first = _rows({("latency", "ours", 4096): 80.0, ("latency", "gloo", 4096): 50.0})
    second = _rows({("latency", "ours", 4096): 60.0, ("latency", "gloo", 4096): 90.0,
                    ("busbw", "horovod", 1024): 1000.0})
    best = {(r["impl"], r["size_bytes"]): round(r["time_us"], 6) for r in timing.best_of([first, second])}
    assert best == {("ours", 4096): 60.0, ("gloo", 4096): 50.0, ("horovod", 1024): 1000.0}
    lines = timing.format_table(_rows({("busbw", "horovod", 1024): 300.0, ("latency", "gloo", 4096): 150.0,
                                       ("latency", "ours", 4096): 100.0, ("busbw", "ours", 1024): 100.0}))
    assert lines[0].split()[:4] == ["#", "measure", "size(B)", "tensors"]
    cells = [line.split() for line in lines[1:]]
    assert [(c[0], c[3]) for c in cells] == [("latency", "ours"), ("latency", "gloo"), ("busbw", "ours"),
                                             ("busbw", "horovod")]      # measures in order, ours first
    assert [c[-1] for c in cells] == ["-", "1.50x", "-", "3.00x"]          # peer time / ours


def test_plan_and_timed_together():
    assert timing.SIZES[0] == 1 << 10 and timing.SIZES[-1] == 64 << 20 and len(timing.SIZES) == 9
    assert timing.plan("busbw", 64 << 20)[0] == 3 and timing.plan("busbw", 1024)[0] == 100
    assert timing.plan("latency", 4096, quick=True) == (10, 1, 1)
    calls, barriers = {"a": 0, "b": 0}, []

    def bump(key):
        calls[key] += 1
    out = timing.timed_together({"a": lambda: bump("a"), "b": lambda: bump("b")}, iters=4, warmup=2, repeats=3,
                                barrier=lambda: barriers.append(1), slowest=lambda t: t + 1.0)
    assert calls == {"a": 2 + 12, "b": 2 + 12} and len(barriers) == 6       # a barrier before every block
    assert set(out) == {"a", "b"} and all(1.0 <= t < 2.0 for t in out.values())   # slowest() applied


def _peers_data(**changes) -> dict:
    records = _rows({("latency", "ours", 4096): 100.0, ("latency", "ours-np", 4096): 50.0,
                     ("latency", "gloo", 4096): 200.0, ("latency", "horovod", 4096): 1000.0,
                     ("busbw", "ours", 1024): 100.0, ("busbw", "ours", 1 << 20): 1000.0,
                     ("busbw", "gloo", 1024): 150.0, ("busbw", "gloo", 1 << 20): 800.0,
                     ("busbw", "horovod", 1024): 900.0, ("busbw", "horovod", 1 << 20): 1100.0})
    data = {"records": records, "skipped": {}, "log": [], "rounds": 2, "training_rounds": 3,
            "training": {"ours": [300.0, 320.0, 310.0], "horovod": [250.0, 260.0, 270.0]},
            "versions": {"horovod-training": {"tensorflow": "2.12.1", "keras": "2.12.0"}},
            "commands": {"ours": "mpirun -np 2 python benchmarks/peers/ours_bench.py --impl ours"},
            "machine": {"cores": 2, "loadavg": [1.5, 1.0, 0.5]}}
    return {**data, **changes}


def test_verdict_lines():
    lines = verdict.peer_goals(_peers_data())
    latency = next(x for x in lines if "latency" in x and "ours (tfops)" in x)
    assert "Gloo **2.00x**" in latency and "Horovod **10.00x**" in latency and latency.endswith("**met**.")
    busbw = next(x for x in lines if "busbw" in x and "ours (tfops)" in x)
    assert "Gloo **0.80x** at 1 MiB" in busbw and busbw.endswith("**not met**.")        # worst size named
    numpy_busbw = next(x for x in lines if "busbw" in x and "ours (numpy)" in x)
    assert "not measured (no row for both)" in numpy_busbw and "**not met**" in numpy_busbw
    train = lines[-1]
    assert "**1.19x**" in train and "Horovod on TF 2.12.1 / Keras 2.12.0, ours on TF 2.21 / Keras 3" in train
    assert "**met**" in train
    skipped = verdict.peer_goals(_peers_data(records=[], training={"ours": [1.0], "horovod": []},
                                             skipped={"horovod": ".venv-horovod is not built"}))
    assert all("not met" in x or "not measured" in x for x in skipped)
    assert ".venv-horovod is not built" in skipped[0] and ".venv-horovod is not built" in skipped[-1]
    page = goals_section({"peers": ("", _peers_data(), "")})
    assert any(x.startswith("- peers, training img/s") for x in page)


def test_section_render_shown_and_missing(monkeypatch, tmp_path):
    text = section.render(_peers_data(skipped={"gloo": "torch is not importable: pip install -e '.[bench]'"}))
    assert "# skipped gloo: torch is not importable" in text and "# load average at the start: 1.5" in text
    assert "#   horovod  horovod.tensorflow 0.28.1" in text
    assert "training     ours    310.0 img/s" in text and "training  horovod    260.0 img/s" in text
    assert "TF 2.12.1 / Keras 2.12.0" in text
    argv = section.commands("/tmp/x", quick=True)
    assert set(argv) == {"ours", "gloo", "horovod", "train-ours", "train-horovod"}
    shown = section.shown(argv["horovod"])
    assert shown.startswith(".venv-horovod/bin/mpirun --bind-to core -np 2 .venv-horovod/bin/python") and \
        "--json" not in shown and "--quick" in shown
    monkeypatch.setattr(section, "HOROVOD_VENV", tmp_path / "absent")
    assert "build_horovod.sh" in section.missing()["horovod"]


def _launch(argv: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    """Run one peer launch like tests.harness.mpirun, with the launch's own mpirun and python."""
    env = mpi_env()
    env["PATH"] = os.path.dirname(argv[0]) + os.pathsep + env.get("PATH", "")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_tagged(env["ALLREDUCE_TEST_TAG"])
        pytest.fail(f"TIMEOUT after {timeout} s: {' '.join(argv)}")
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    return subprocess.CompletedProcess(argv, 0, out, err)


@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch absent: pip install -e '.[bench]'")
def test_gloo_launch(tmp_path):
    out = tmp_path / "gloo.json"
    argv = [*section._mpirun(None), sys.executable, "benchmarks/peers/ours_bench.py", "--impl", "gloo", "--quick",
            "--measures", "latency,busbw", "--max-bytes", "4096", "--json", str(out)]
    argv[0] = os.path.join(os.path.dirname(sys.executable), "mpirun")
    proc = _launch(argv)
    rows = json.loads(out.read_text())["records"]
    assert [(r["measure"], r["impl"], r["size_bytes"]) for r in rows] == [
        ("latency", "gloo", 4096), ("busbw", "gloo", 1024), ("busbw", "gloo", 4096)]
    assert all(r["time_us"] > 0 and r["ranks"] == 2 for r in rows)
    assert "# measure" in proc.stdout


@pytest.mark.mpi
@pytest.mark.skipif(not (section.HOROVOD_VENV / "bin" / "python").is_file(),
                    reason=".venv-horovod absent: bash benchmarks/peers/build_horovod.sh")
def test_horovod_launch(tmp_path):
    out = tmp_path / "hvd.json"
    argv = [*section._mpirun(section.HOROVOD_VENV / "bin"), str(section.HOROVOD_VENV / "bin" / "python"),
            "benchmarks/peers/horovod_bench.py", "--quick", "--measures", "latency", "--json", str(out)]
    _launch(argv)
    data = json.loads(out.read_text())
    assert data["horovod"] == "0.28.1" and data["tensorflow"].startswith("2.12")
    (row,) = data["records"]
    assert (row["measure"], row["impl"], row["size_bytes"], row["ranks"]) == ("latency", "horovod", 4096, 2)
