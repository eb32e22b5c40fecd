"""The benchmark's arithmetic, formats and checks (no timing is asserted anywhere)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from allreduce.ops import bfloat16
from benchmarks import checks, common


@pytest.mark.parametrize("text, value", [("8", 8), ("4K", 4096), ("4k", 4096), ("64M", 64 << 20),
                                         ("1G", 1 << 30), ("2KiB", 2048), ("16MB", 16 << 20), (" 3 ", 3)])
def test_parse_size(text, value):
    assert common.parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "x", "4T", "-8", "1.5M", "K"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="bad size"):
        common.parse_size(bad)


def test_size_list():
    assert common.size_list(8, 128, 2) == [8, 16, 32, 64, 128]
    assert common.size_list(8, 100, 4) == [8, 32]
    assert common.size_list(1, 3, 1.5) == [1, 2, 3]
    with pytest.raises(ValueError):
        common.size_list(16, 8, 2)
    with pytest.raises(ValueError):
        common.size_list(8, 16, 1)


def test_bandwidths_match_hand_computed_values():
    # 64 MiB in 10 ms: algbw = 67108864 / 0.01 / 1e9 = 6.7108864 GB/s
    algbw, busbw = common.bandwidths(64 << 20, 0.01, "allreduce", 4)
    assert algbw == pytest.approx(6.7108864)
    assert busbw == pytest.approx(6.7108864 * 2 * 3 / 4)         # 10.0663296
    assert common.bandwidths(1000, 1e-6, "allreduce", 2) == pytest.approx((1.0, 1.0))
    assert common.bandwidths(1000, 1e-6, "allgather", 4)[1] == pytest.approx(0.75)
    assert common.bandwidths(1000, 1e-6, "reducescatter", 8)[1] == pytest.approx(7 / 8)
    assert common.bandwidths(1000, 1e-6, "broadcast", 8)[1] == pytest.approx(1.0)
    assert common.bus_factor("allreduce", 1) == 0.0
    with pytest.raises(ValueError):
        common.bus_factor("alltoall", 2)


def test_table_round_trip():
    row = common.Row("allreduce", 1024, 256, "float32", "sum", "ring", 2, 12.5, 0.082, 0.082, wrong=0,
                     bound_frac=0.25)
    unchecked = common.Row("allreduce", 8 << 30, 4 << 30, "bfloat16", "avg", "hierarchical", 2, 1.5e9, 0.003, 0.003)
    text = "\n".join(common.table_header() + [common.format_row(row), common.format_row(unchecked)])
    rows = common.parse_table(text)
    assert [r["algorithm"] for r in rows] == ["ring", "hierarchical"]
    assert rows[0]["size_bytes"] == 1024 and rows[0]["wrong"] == 0 and rows[0]["bound_pct"] == 25.0
    assert rows[1]["wrong"] is None and rows[1]["bound_pct"] is None and rows[1]["dtype"] == "bfloat16"
    assert rows[1]["size_bytes"] == 8 << 30 and rows[1]["time_us"] == 1.5e9


def test_osu_round_trip():
    row = common.Row("allreduce", 4096, 1024, "float32", "sum", "rd", 2, 30.0, 0.1, 0.1,
                     min_us=20.0, avg_us=25.0, max_us=30.0, iters=100)
    text = "\n".join(common.osu_header("allreduce", "rd") + [common.format_osu(row)])
    assert text.startswith("# OSU MPI Allreduce Latency Test")
    assert common.parse_osu(text) == {"rd": [{"size": 4096, "avg_us": 25.0, "min_us": 20.0, "max_us": 30.0,
                                              "iters": 100}]}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.float64, np.int32, np.int8, np.uint8])
@pytest.mark.parametrize("op", common.OP_NAMES)
@pytest.mark.parametrize("p", [1, 3, 8])
def test_expected_is_the_exact_reduction(dtype, op, p):
    dtype = np.dtype(dtype)
    count = 37
    inputs = [checks.make_input(r, p, count, dtype, op).astype(np.float64) for r in range(p)]
    want = checks.expected(0, p, count, dtype, op, "allreduce")
    assert want.dtype == dtype and want.shape == (count,)
    exact = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](inputs, axis=0)
    if op == "avg":
        exact = np.trunc(exact / p) if dtype.kind in "iu" else exact / p
    if dtype.kind in "iu":
        exact = exact.astype(np.int64).astype(dtype)             # integer products wrap
    assert checks.count_wrong(exact.astype(dtype), want, op) == 0


def test_count_wrong_counts_each_bad_element():
    want = checks.expected(0, 2, 16, np.dtype(np.float32), "sum", "allreduce")
    got = want.copy()
    got[3] += 1
    got[7] = np.nan
    assert checks.count_wrong(got, want, "sum") == 2
    assert checks.count_wrong(got[:5], want, "sum") == 16             # wrong shape: all wrong


def test_average_allows_one_ulp_only():
    want = np.array([1 / 3], np.float16)
    one_ulp = np.nextafter(want, np.float16(1))
    assert checks.count_wrong(one_ulp, want, "avg") == 0
    assert checks.count_wrong(np.nextafter(one_ulp, np.float16(1)), want, "avg") == 1


def test_other_collectives_expected_shapes():
    p, count, dt = 4, 12, np.dtype(np.float32)
    assert checks.counts(100, dt, "allgather", p) == (24, 6)
    assert checks.counts(100, dt, "reducescatter", p) == (24, 24)
    assert checks.counts(1, dt, "allreduce", p) == (1, 1)
    gathered = checks.expected(2, p, count, dt, "sum", "allgather")
    assert np.array_equal(gathered[3:6], checks.make_input(1, p, 3, dt, "sum"))
    full = checks.expected(0, p, count, dt, "max", "allreduce")
    assert np.array_equal(checks.expected(2, p, count, dt, "max", "reducescatter"), full[6:9])
    root = checks.make_input(0, p, count, dt, "sum")
    assert np.array_equal(checks.expected(3, p, count, dt, "sum", "broadcast"), root)


@pytest.mark.parametrize("op", common.OP_NAMES)
def test_timing_input_is_stable(op):
    from allreduce import kernels
    from allreduce.ops import Op
    x = checks.timing_input(64, np.dtype(np.float16), op)
    code = {"sum": Op.SUM, "avg": Op.AVERAGE, "min": Op.MIN, "max": Op.MAX, "prod": Op.PRODUCT}[op]
    y = x.copy()
    for _ in range(50):
        kernels.reduce_finish_into(y, x, code, 2)
    assert np.array_equal(y, x)


@pytest.mark.parametrize("collective, op", [("allreduce", "avg"), ("broadcast", "sum"), ("allgather", "sum"),
                                            ("reducescatter", "max"), ("reducescatter", "prod")])
@pytest.mark.parametrize("dtype", [np.float32, bfloat16, np.int32])
def test_check_accepts_our_collectives_on_threads(collective, op, dtype):
    """The -c path end to end (inputs, runner, expected, count) on 3 in-process ranks."""
    from allreduce import Communicator, Config
    from allreduce.transport.threads import run_threads
    from benchmarks.peers import Context, make_runner

    p, dtype = 3, np.dtype(dtype)

    def body(transport):
        comm = Communicator(transport, config=Config(check=False))
        run = make_runner("ring" if collective == "allreduce" else "ours",
                          Context(comm=comm, mpi_comm=None, collective=collective, dtype=dtype, op=op))
        wrong = []
        for size in (4, 100, 4096):
            count, in_count = checks.counts(size, dtype, collective, p)
            got = run(checks.make_input(transport.rank, p, in_count, dtype, op))
            wrong.append(checks.count_wrong(got, checks.expected(transport.rank, p, count, dtype, op, collective),
                                            op))
        return wrong

    assert run_threads(p, body, timeout=30) == [[0, 0, 0]] * p


def test_time_size_round_robin_keeps_fastest_block(monkeypatch):
    """--repeats: blocks alternate between algorithms and each keeps its fastest; -n/-w counts are exact."""
    import argparse
    from benchmarks import allreduce_bench

    class OneRank:                      # the three mpi4py calls time_size makes, for a single process
        def Barrier(self):
            pass

        def allgather(self, value):
            return [value]

    calls = []
    durations = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 2.0, 7.0])}   # seconds per block, in order

    def runner(name):
        def run(x):
            calls.append(name)
        return run

    def fake_block(run, x, iters, mpi):
        for _ in range(iters):
            run(x)
        return next(durations[calls[-1]])

    monkeypatch.setattr(allreduce_bench, "time_block", fake_block)
    args = argparse.Namespace(iters=2, warmup_iters=1, budget=0.0, repeats=3)
    got = allreduce_bench.time_size({"a": runner("a"), "b": runner("b")}, np.zeros(1), args, OneRank())
    assert got == {"a": ([1.0], 2), "b": ([2.0], 2)}
    assert "".join(calls) == "aabb" + "aabb" * 3        # a priming call + -w 1 warmup each, then round-robin blocks of -n 2


def test_sweep_warm_up_runs_every_algorithm_alike():
    """The one warm-up before the first size: every runner the same number of times (each call is a
    collective: the ranks agree on the rounds), round-robin; 0 seconds runs nothing."""
    from benchmarks import allreduce_bench

    class OneRank:
        def allreduce(self, value, op=None):
            return value

    calls = []
    runners = {name: (lambda x, name=name: calls.append(name)) for name in "abc"}
    assert allreduce_bench.warm_up_sweep(runners, [np.zeros(1)], 0.0, OneRank()) == 0 and calls == []
    rounds = allreduce_bench.warm_up_sweep(runners, [np.zeros(1)], 0.01, OneRank())
    assert rounds >= 2 and calls == list("abc") * rounds
    assert allreduce_bench.parse_args(["--warmup-seconds", "0"]).warmup_seconds == 0
    with pytest.raises(SystemExit):
        allreduce_bench.parse_args(["--warmup-seconds", "-1"])


def test_command_line_shows_chosen_mca_but_not_the_library_default(monkeypatch):
    from allreduce.config import ENV_VARIABLES
    for name in ENV_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_MCA_osc", "^ucx")          # what allreduce sets itself: not shown
    monkeypatch.setenv("OMPI_MCA_btl", "tcp,self")      # a user's choice: shown
    assert common.command_line(["b.py"]) == "allreduce-run --mca btl tcp,self -np 2 python b.py"
    monkeypatch.setenv("OMPI_MCA_osc", "sm")
    assert common.command_line(["b.py"]) == "allreduce-run --mca btl tcp,self --mca osc sm -np 2 python b.py"


def test_cross_core_probe_on_threads():
    """Both figures reach every rank; one rank has nobody to share with."""
    from allreduce.transport.threads import ThreadWorld
    from benchmarks import membw
    world = ThreadWorld(3)
    out = [None] * 3

    def rank(r):
        out[r] = membw.cross_core(world.transport(r), 1 << 16, rounds=5)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(o is not None and o == out[0] for o in out)
    assert all(0 < v < float("inf") for v in out[0])
    assert membw.cross_core(ThreadWorld(1).transport(0)) is None


def test_report_names_each_saved_sections_time(tmp_path, monkeypatch):
    """BENCHMARKS.md's header says when re-rendered sections ran: one time, or one per section."""
    import os
    from benchmarks import report
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    for name, stamp in (("np2", 1_800_000_000), ("np4", 1_800_000_010), ("engine", 1_800_000_600)):
        path = tmp_path / f"{name}.json"
        path.write_text("{}")
        os.utime(path, (stamp, stamp))
    assert report._saved_times(["np2", "np4"]) == "2027-01-15 08:00 UTC"
    assert report._saved_times(["np2", "engine"]) == "np2 2027-01-15 08:00 UTC, engine 2027-01-15 08:10 UTC"
