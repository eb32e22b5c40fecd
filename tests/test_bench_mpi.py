"""Smoke runs of benchmarks/allreduce_bench.py on 2 ranks: tiny sizes, -c, every output format.

Correctness only (#wrong == 0, well-formed table, JSON and OSU output);
no timing is asserted.
"""
from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import common
from tests.harness import ROOT, mpirun

pytestmark = pytest.mark.mpi

BENCH = ROOT / "benchmarks" / "allreduce_bench.py"
QUICK = ("-n", "2", "-w", "1", "--membw-mib", "4", "--warmup-seconds", "0.05")
KEYS = {"collective", "size_bytes", "count", "dtype", "op", "algorithm", "ranks", "time_us", "algbw_gbps",
        "busbw_gbps", "wrong"}


def test_table_json_and_check(tmp_path):
    out = tmp_path / "run.json"
    # Every default name but gloo (slow to import; it has its own test below).
    proc = mpirun(2, BENCH, "-b", "8", "-e", "4K", "-f", "8", "-c", "--json", str(out),
                  "--algorithms", "ring,tree,rhd,rd,mpi,mpi4py,horovod", *QUICK, timeout=180)
    rows = common.parse_table(proc.stdout)
    algorithms = {r["algorithm"] for r in rows}
    assert {"ring", "rd", "mpi", "mpi4py"} <= algorithms
    assert {r["size_bytes"] for r in rows} == {8, 64, 512, 4096}
    assert all(r["wrong"] == 0 for r in rows), proc.stdout
    assert "# command: allreduce-run -np 2 python" in proc.stdout and "# B_mem = " in proc.stdout
    assert "metadata check (check=True) adds" in proc.stdout
    assert "GB/s reading lines the peer wrote" in proc.stdout      # the cross-core probe
    assert "OSC UCX" not in proc.stderr           # MPI started with the library's Open MPI defaults
    # present, or skipped with a note: never silently missing
    assert "horovod" in algorithms or "# skipped horovod: horovod: horovod.torch is not importable" in proc.stdout
    data = json.loads(out.read_text())
    assert data["command"].startswith("allreduce-run -np 2") and data["machine"]["cores"] >= 1
    assert data["gamma_s_per_byte"] > 0 and data["membw_gbps"] > 0
    assert data["cross_core_gbps"]["read"] > 0 and data["cross_core_gbps"]["rewrite"] > 0
    assert len(data["records"]) == len(rows)
    for record in data["records"]:
        assert KEYS <= set(record) and record["ranks"] == 2 and record["wrong"] == 0
        algbw, busbw = common.bandwidths(record["size_bytes"], record["time_us"] * 1e-6, "allreduce", 2)
        assert record["busbw_gbps"] == pytest.approx(busbw)


def test_osu_format_half_precision_average():
    proc = mpirun(2, BENCH, "-b", "2", "-e", "2K", "-f", "32", "-c", "-d", "float16", "-o", "avg",
                  "--algorithms", "ring,rd,mpi,mpi4py", "--osu", *QUICK, timeout=180)
    blocks = common.parse_osu(proc.stdout)
    assert set(blocks) == {"ring", "rd", "mpi"}
    assert "# skipped mpi4py: mpi4py: MPI has no float16 type to reduce" in proc.stdout
    for lines in blocks.values():
        assert [b["size"] for b in lines] == [2, 64, 2048]
        assert all(b["min_us"] <= b["avg_us"] <= b["max_us"] and b["iters"] == 2 for b in lines)
    assert "Out of bounds" not in proc.stdout       # OSU blocks only


def test_other_collective_with_peer():
    # Our broadcast/allgather/reducescatter are checked on threads in test_bench.py; this is the MPI path.
    proc = mpirun(2, BENCH, "--collective", "reducescatter", "-o", "max", "-b", "8", "-e", "1K", "-f", "128", "-c",
                  "--algorithms", "ours,mpi4py", *QUICK, timeout=180)
    rows = common.parse_table(proc.stdout)
    assert {r["algorithm"] for r in rows} == {"ours", "mpi4py"}, proc.stdout
    assert all(r["wrong"] == 0 and r["bound_pct"] is None for r in rows), proc.stdout
    assert {r["size_bytes"] for r in rows} == {8, 1024}


def test_gloo_peer_or_skip_note():
    proc = mpirun(2, BENCH, "-b", "8", "-e", "1K", "-f", "128", "-c", "-o", "avg", "--algorithms", "gloo,mpi",
                  *QUICK, timeout=180)
    rows = common.parse_table(proc.stdout)
    if importlib.util.find_spec("torch") is None:
        assert "# skipped gloo: gloo: torch is not importable" in proc.stdout
        assert {r["algorithm"] for r in rows} == {"mpi"}
    else:
        assert {r["algorithm"] for r in rows} == {"gloo", "mpi"}, proc.stdout
    assert all(r["wrong"] == 0 for r in rows), proc.stdout


def test_cold_rotates_over_distinct_inputs_and_says_so(tmp_path):
    """--cold: the timed calls cycle through distinct buffers spanning the given MiB; results stay exact."""
    from benchmarks import allreduce_bench
    args = allreduce_bench.parse_args(["--cold", "1", "-o", "sum"])
    xs = allreduce_bench.timing_inputs(16 << 10, common.dtype_from_name("float32"), args)
    assert len(xs) == 16 and len({x.ctypes.data for x in xs}) == 16          # 16 x 64 KiB = 1 MiB
    assert len(allreduce_bench.timing_inputs(16 << 10, common.dtype_from_name("float32"),
                                             allreduce_bench.parse_args([]))) == 1
    out = tmp_path / "cold.json"
    # shm-reg keeps a registered copy of each of the 16 inputs (16 collective allocations)
    proc = mpirun(2, BENCH, "-b", "64K", "-e", "64K", "-c", "--cold", "1", "--algorithms", "ring,shm,shm-reg,mpi",
                  "--json", str(out), *QUICK, timeout=120)
    rows = common.parse_table(proc.stdout)
    assert {r["algorithm"] for r in rows} == {"ring", "shm", "shm-reg", "mpi"} and all(r["wrong"] == 0 for r in rows)
    assert "cold: the calls rotate over distinct inputs spanning 1 MiB" in proc.stdout
    assert json.loads(out.read_text())["cold_mib"] == 1
