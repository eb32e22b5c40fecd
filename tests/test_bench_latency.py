"""benchmarks/latency_bench.py (the default call against raw MPI) and its goal lines (issue 28).

One short -np 2 launch checks the table, the load lines and the JSON the report reads; the goal
lines are checked on made-up rows (no timing is asserted anywhere)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import goals
from tests.harness import mpirun

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "latency_bench.py"


def test_latency_bench_table_and_json(tmp_path):
    out = tmp_path / "defaultcall.json"
    proc = mpirun(2, BENCH, "-b", "8", "-e", "32", "-n", "5", "--repeats", "2", "--settle", "5",
                  "--json", str(out), timeout=120)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("# command: allreduce-run --bind-to core -np 2 python benchmarks/latency_bench.py")
               for line in lines), proc.stdout
    assert sum("load average" in line for line in lines) >= 2, proc.stdout      # at the start and the end
    data = json.loads(out.read_text())
    assert [r["size_bytes"] for r in data["records"]] == [8, 16, 32]
    for r in data["records"]:
        assert r["ranks"] == 2 and r["mpi4py_us"] > 0 and r["default_us"] > 0
        assert abs(r["default_over_mpi4py"] - r["default_us"] / r["mpi4py_us"]) < 1e-9
        assert abs(r["check_us"] - (r["default_us"] - r["check_off_us"])) < 1e-9


def _row(size, mpi4py, default, off):
    return {"size_bytes": size, "mpi4py_us": mpi4py, "default_us": default, "check_off_us": off,
            "check_us": default - off, "default_over_mpi4py": default / mpi4py}


def test_default_call_goals_worst_size_and_check():
    met = goals.default_call_goals([_row(8, 1.0, 2.5, 2.4), _row(4096, 4.0, 5.0, 5.2)])
    assert "**2.50x**" in met[0] and "**met**" in met[0] and "within 3x: 8 B, 4 KiB" in met[0]
    assert "**0.10 us**" in met[1] and "**met**" in met[1]
    missed = goals.default_call_goals([_row(8, 1.0, 3.5, 2.0), _row(1024, 2.0, 4.0, 3.9)])
    assert "**3.50x**" in missed[0] and "**not met**" in missed[0] and "within 3x: 1 KiB" in missed[0]
    assert "**1.50 us**" in missed[1] and "**not met**" in missed[1]
    assert goals.default_call_goals([]) == []


def test_engine_goal_against_raw_mpi_calls():
    rows = [{"mode": "fusion", "algorithm": a, "size_bytes": 4096000, "time_us": t}
            for a, t in (("engine", 2000.0), ("unfused-blocking", 3000.0), ("native-unfused", 2500.0),
                         ("native-fused", 900.0))]
    line = next(x for x in goals.engine_goals(rows) if "raw MPI_Allreduce calls" in x)
    assert "**1.25x**" in line and "**met**" in line and "Per tensor" not in line
    # With the floor rows (engine_bench's pack and bare handles), the line says what 1.0x leaves.
    for r in rows:
        r["tensors"] = 1 if r["algorithm"] == "native-fused" else 1000
    rows += [{"mode": "fusion", "algorithm": a, "size_bytes": 4096000, "time_us": t, "tensors": n}
             for a, t, n in (("pack", 400.0, 1), ("handles", 300.0, 1000))]
    line = next(x for x in goals.engine_goals(rows) if "raw MPI_Allreduce calls" in x)
    assert "a raw call 2.50 us" in line and "1.0x leaves 1.20 us" in line and "spends 0.70 us" in line
    assert "bare handle (made, completed, waited on) costs 0.30 us" in line and "passes 1.56x" in line
