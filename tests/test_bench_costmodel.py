"""fit_costmodel recovers known constants from synthetic timings; the goals' ratio arithmetic (goals.py)."""
from __future__ import annotations

import json

import pytest

from allreduce.algorithms import select
from benchmarks import fit_costmodel, goals

TRUE = {"ring": {"alpha": 30e-6, "beta": 0.4e-9, "gamma": 0.12e-9},
        "tree": {"alpha": 12e-6, "beta": 0.3e-9, "gamma": 0.12e-9},
        "rd": {"alpha": 8e-6, "beta": 0.5e-9, "gamma": 0.12e-9},
        "rhd": {"alpha": 20e-6, "beta": 0.35e-9, "gamma": 0.2e-9}}
SIZES = [8 << k for k in range(0, 24, 2)]


def _rows(constants, ranks):
    return [{"algorithm": algo, "size_bytes": n, "ranks": p, "collective": "allreduce",
             "time_us": fit_costmodel.predict(c, algo, n, p) * 1e6}
            for algo, c in constants.items() for p in ranks for n in SIZES]


@pytest.mark.parametrize("ranks", [[2], [2, 4, 8]])
def test_fit_recovers_alpha_beta_with_measured_gamma(ranks):
    rows = _rows({k: TRUE[k] for k in ("ring", "tree", "rd")}, ranks)
    got = fit_costmodel.fit(rows, gamma=0.12e-9)
    for algo in ("ring", "tree", "rd"):
        for name in ("alpha", "beta", "gamma"):
            assert got[algo][name] == pytest.approx(TRUE[algo][name], rel=1e-6), (algo, name)


def test_fit_gamma_when_runs_separate_it():
    # rd on 3 and 6 ranks (not powers of two) has b(p)/g(p) != 1 unlike p = 2, 4: all three are identifiable.
    true = dict(TRUE["rd"], gamma=0.2e-9)
    rows = _rows({"rd": true}, [2, 3, 4, 6])
    got = fit_costmodel.fit(rows, gamma=None, fit_gamma=True)["rd"]
    for name in ("alpha", "beta", "gamma"):
        assert got[name] == pytest.approx(true[name], rel=1e-6)


def test_fit_gamma_refuses_collinear_runs():
    with pytest.raises(ValueError, match="collinear"):
        fit_costmodel.fit(_rows({"ring": TRUE["ring"]}, [2, 3, 4, 8]), gamma=None, fit_gamma=True)


def test_without_gamma_beta_absorbs_it_and_predictions_agree():
    rows = _rows({"ring": TRUE["ring"]}, [2])
    got = fit_costmodel.fit(rows, gamma=None)["ring"]
    assert got["gamma"] == 0 and got["alpha"] == pytest.approx(TRUE["ring"]["alpha"], rel=1e-6)
    for n in SIZES:
        assert fit_costmodel.predict(got, "ring", n, 2) == pytest.approx(
            fit_costmodel.predict(TRUE["ring"], "ring", n, 2), rel=1e-6)


def test_noisy_fit_stays_close_and_nonnegative():
    import numpy as np
    rows = _rows({"tree": TRUE["tree"]}, [2])
    rng = np.random.default_rng(0)
    for r in rows:
        r["time_us"] *= 1 + 0.05 * rng.standard_normal()
    got = fit_costmodel.fit(rows, gamma=0.12e-9)["tree"]
    assert got["alpha"] == pytest.approx(TRUE["tree"]["alpha"], rel=0.15)
    assert got["beta"] == pytest.approx(TRUE["tree"]["beta"], rel=0.15)
    assert min(got.values()) >= 0


def test_main_writes_what_select_reads(tmp_path, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"ranks": 2, "gamma_s_per_byte": 0.12e-9, "records": _rows(TRUE, [2]) +
                               [{"algorithm": "gloo", "size_bytes": 8, "ranks": 2, "time_us": 5.0}]}))
    out = tmp_path / "costmodel.json"
    assert fit_costmodel.main([str(run), "--out", str(out)]) == 0
    assert "predicted (us)" in capsys.readouterr().out
    table = select.constants(str(out))
    assert table["ring"]["alpha"] == pytest.approx(TRUE["ring"]["alpha"], rel=1e-6)
    assert "gloo" not in json.loads(out.read_text())["constants"]      # peers are not modelled


def test_report_ratios():
    recs = [{"algorithm": a, "size_bytes": s, "busbw_gbps": bw, "time_us": t}
            for a, s, bw, t in [("ring", 64 << 20, 1.8, 0), ("mpi", 64 << 20, 2.0, 0),
                                ("rd", 8, 0, 30.0), ("mpi", 8, 0, 10.0), ("rd", 4096, 0, 40.0),
                                ("mpi", 4096, 0, 40.0), ("rd", 8192, 0, 99.0), ("mpi", 8192, 0, 1.0)]]
    assert goals.bandwidth_ratio(recs) == pytest.approx(0.9)
    assert goals.bandwidth_ratio(recs, ours="tree") is None
    assert goals.latency_ratios(recs, "rd") == {8: pytest.approx(3.0), 4096: pytest.approx(1.0)}


def test_report_goals_say_met_not_met_or_not_measured():
    def rec(algo, size, busbw=0.0, t=0.0):
        return {"algorithm": algo, "size_bytes": size, "busbw_gbps": busbw, "time_us": t}
    runs = {"np2": ("", {"records": [rec("ring", 64 << 20, 1.0), rec("mpi", 64 << 20, 2.0)]}, ""),
            "latency": ("", {"records": [rec("rd", 8, t=10), rec("mpi", 8, t=10), rec("tree", 8, t=25)]}, "")}
    text = "\n".join(goals.goals_section(runs))
    assert "ring busbw at 64 MiB float32 / native MPI (`mpi`), -np 2: **0.50x** (goal >= 0.9x): **not met**." in text
    assert "rd latency 8 B..4 KiB / native MPI (`mpi`), worst size: **1.00x**" in text and "**met**." in text
    assert "tree latency" in text and "**2.50x** (goal <= 2x at every size): **not met**." in text
    runs["np2"] = ("", {"records": [rec("ring", 64 << 20, 1.0)]}, "")
    assert "not measured in this run" in "\n".join(goals.goals_section(runs))


def test_auto_goal_says_whether_the_worst_gap_is_the_pick():
    """auto vs the best single algorithm: the verdict stands either way; the note says what auto ran."""
    def rec(algo, size, t):
        return {"algorithm": algo, "size_bytes": size, "busbw_gbps": 1.0, "time_us": t}
    records = [rec("mpi", 64, 3.0), rec("rd", 64, 5.0), rec("auto", 64, 4.0),
               rec("mpi", 4096, 9.0), rec("rd", 4096, 6.0), rec("auto", 4096, 6.3)]
    same = "\n".join(goals.shm_and_auto_goals(records, "-np 2", {"64": "mpi", "4096": "rd"}))
    assert "**1.33x** (goal <= 1.10x at every size): **not met**." in same
    assert "where mpi was fastest; auto ran mpi there too" in same
    wrong = "\n".join(goals.shm_and_auto_goals(records, "-np 2", {"64": "rd"}))
    assert "where mpi was fastest; auto ran rd there)" in wrong
    assert "where mpi was fastest)" in "\n".join(goals.shm_and_auto_goals(records, "-np 2"))


def test_shm_goals_cover_both_ways_and_leave_shm_reg_out_of_autos_contest():
    """shm and shm-reg (registered buffers) each get their busbw and %bound lines, with their own
    traffic; auto is compared only with what it chooses among (a private buffer: not shm-reg)."""
    def rec(algo, size, busbw, t, bound):
        return {"algorithm": algo, "size_bytes": size, "busbw_gbps": busbw, "time_us": t,
                "bound_frac": bound, "ranks": 4}
    big = 16 << 20
    records = [rec("mpi", big, 2.0, 100.0, 0.3), rec("shm", big, 2.4, 80.0, 0.4),
               rec("shm-reg", big, 4.0, 50.0, 0.7), rec("auto", big, 2.4, 80.0, 0.4)]
    text = "\n".join(goals.shm_and_auto_goals(records, "-np 4"))
    assert "- shm busbw / native MPI, -np 4, 4 MiB and up, worst size: **1.20x** (goal >= 1.5x): **not met**." in text
    assert ("- shm on registered buffers (`shared_empty`, no copy-in) busbw / native MPI, -np 4, 4 MiB and up, "
            "worst size: **2.00x** (goal >= 1.5x): **met**.") in text
    assert ("worst size: **70%** (goal >= 60%): **met**. shm-reg moves `shm.traffic(p, registered=True)` bytes "
            "per byte") in text
    assert "2 at p = 4" in text and "4.5 at p = 4" in text
    assert "auto / best single algorithm, -np 4, worst size: **1.00x**" in text


def test_report_training_ratios_and_goals():
    def row(n, tfops, mwms=None):
        r = {"np": n, "tfops": {"total": tfops, "conf": 1.0}}
        return r | ({"mwms": {"total": mwms, "conf": 1.0}} if mwms else {})
    data = {"runs": {"1": row(1, 100.0), "2": row(2, 190.0, 200.0)}, "machine": {"loadavg": [0.5], "cores": 2}}
    r = goals.training_ratios(data)
    assert r["vs_mwms"] == pytest.approx(0.95) and r["efficiency"] == pytest.approx(0.95)
    assert r["mwms_efficiency"] == pytest.approx(1.0)
    text = "\n".join(goals.training_goals(data))
    assert "**0.95x** (goal >= 1.0x): **not met**." in text and "**95%** (goal >= 90%): **met**." in text
    assert "Caution" not in text
    data["runs"]["2"] = row(2, 150.0)                      # no MWMS row: said so, efficiency still computed
    data["machine"]["loadavg"] = [5.0]
    text = "\n".join(goals.training_goals(data))
    assert "not measured in this run" in text and "**75%** (goal >= 90%): **not met**." in text
    assert "Caution" in text
    data["runs"]["2"]["barrier"] = {"total": 160.0, "conf": 1.0}   # a barrier in the exchange's place
    r = goals.training_ratios(data)
    assert r["barrier_efficiency"] == pytest.approx(0.8)
    assert "only a barrier where the exchange goes" in "\n".join(goals.training_goals(data)) and "80%" in \
        "\n".join(goals.training_goals(data))


def test_measured_table_decides_for_measured_world_sizes(tmp_path):
    """fit_costmodel keeps the measured times per world size; choose() interpolates them in log(size)
    for that p, and falls back to the model for another p or an unmeasured candidate."""
    from allreduce.algorithms import select
    from benchmarks import fit_costmodel
    rows = [{"algorithm": a, "ranks": 2, "size_bytes": n, "time_us": t} for a, n, t in [
        ("mpi", 1024, 5.0), ("ring", 1024, 50.0), ("mpi", 1 << 20, 900.0), ("ring", 1 << 20, 300.0),
        ("mpi", 1 << 26, 9000.0), ("ring", 1 << 26, 20000.0)]]
    table = fit_costmodel.measured_table(rows)
    assert table == {"2": [[1024, {"mpi": 5.0, "ring": 50.0}], [1 << 20, {"mpi": 900.0, "ring": 300.0}],
                           [1 << 26, {"mpi": 9000.0, "ring": 20000.0}]]}
    path = tmp_path / "cm.json"
    fit_costmodel.write_constants(path, {}, ["test"], table)
    select.clear_cache()
    try:
        pick = lambda n, p=2, c=("ring", "mpi"): select.choose(n, p, candidates=c, path=str(path))  # noqa: E731
        assert pick(8) == "mpi" and pick(1024) == "mpi"            # below and at the smallest size
        assert pick(1 << 20) == "ring" and pick(1 << 22) == "ring"  # measured, and interpolated
        assert pick(1 << 26) == "mpi" and pick(1 << 30) == "mpi"    # at and beyond the largest
        assert pick(1 << 20, c=("ring", "mpi", "tree")) == select.choose(
            1 << 20, 2, candidates=("ring", "mpi", "tree"), path=str(tmp_path / "none.json"))  # tree unmeasured
        assert pick(1 << 20, p=3) == select.choose(1 << 20, 3, candidates=("ring", "mpi"),
                                                   path=str(tmp_path / "none.json"))         # p = 3 unmeasured
    finally:
        select.clear_cache()


def test_builtin_table_stands_in_only_without_a_machine_file(tmp_path, monkeypatch):
    """No per-machine fit: the package's measured table decides (and explain_choice shows its times);
    a machine file, or an explicit path, replaces it."""
    from allreduce.algorithms import select
    from allreduce.algorithms.explain_choice import explain_choice
    from benchmarks import fit_costmodel
    rows = [{"algorithm": a, "ranks": 2, "size_bytes": n, "time_us": t} for a, n, t in [
        ("mpi", 1024, 5.0), ("ring", 1024, 50.0), ("mpi", 1 << 26, 900.0), ("ring", 1 << 26, 90000.0)]]
    builtin = tmp_path / "builtin.json"
    fit_costmodel.write_builtin(builtin, fit_costmodel.measured_table(rows), {}, ["run.json"])
    monkeypatch.setattr(select, "BUILTIN", builtin)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    select.clear_cache()
    try:
        assert select.choose(1 << 26, 2, candidates=("ring", "mpi")) == "mpi"      # the model says ring
        assert "built-in table" in select.source()
        text = explain_choice(1 << 26, 2, candidates=("ring", "mpi"))
        assert "measured at this p" in text and "900.0" in text
        explicit = str(tmp_path / "none.json")
        assert select.choose(1 << 26, 2, candidates=("ring", "mpi"), path=explicit) == "ring"
        assert "built-in constants" in select.source(explicit)
        fit_costmodel.write_constants(select.default_path(), {}, ["test"],
                                      {"2": [[1 << 26, {"mpi": 9e6, "ring": 1.0}]]})
        select.clear_cache()
        assert select.choose(1 << 26, 2, candidates=("ring", "mpi")) == "ring"     # the machine's own run
        assert str(select.default_path()) in select.source()
    finally:
        select.clear_cache()


def test_cold_runs_decide_for_the_engine_within_their_sizes(tmp_path):
    """Rows of an allreduce_bench --cold run form their own table; choose(cold=True) (the engine's
    communicator) goes by it inside its size range and by the warm table elsewhere."""
    import json
    from allreduce.algorithms import select
    from benchmarks import fit_costmodel
    warm = {"ranks": 2, "records": [{"algorithm": a, "ranks": 2, "size_bytes": n, "time_us": t} for a, n, t in [
        ("mpi", 1024, 5.0), ("shm", 1024, 50.0), ("mpi", 1 << 22, 300.0), ("shm", 1 << 22, 400.0)]]}
    cold = {"ranks": 2, "cold_mib": 256, "records": [
        {"algorithm": a, "ranks": 2, "size_bytes": n, "time_us": t} for a, n, t in [
            ("mpi", 1 << 20, 300.0), ("shm", 1 << 20, 200.0), ("mpi", 1 << 22, 1000.0), ("shm", 1 << 22, 800.0)]]}
    files = []
    for name, data in (("warm.json", warm), ("cold.json", cold)):
        (tmp_path / name).write_text(json.dumps(data))
        files.append(str(tmp_path / name))
    rows, _ = fit_costmodel.load_rows(files)
    assert fit_costmodel.measured_table(rows)["2"][-1] == [1 << 22, {"mpi": 300.0, "shm": 400.0}]
    assert fit_costmodel.measured_table(rows, cold=True)["2"][0] == [1 << 20, {"mpi": 300.0, "shm": 200.0}]
    path = tmp_path / "cm.json"
    fit_costmodel.write_constants(path, {}, files, fit_costmodel.measured_table(rows),
                                  fit_costmodel.measured_table(rows, cold=True))
    select.clear_cache()
    try:
        pick = lambda n, cold: select.choose(n, 2, candidates=("mpi", "shm"), path=str(path), cold=cold)  # noqa: E731
        assert pick(1 << 22, False) == "mpi" and pick(1 << 22, True) == "shm"
        assert pick(2 << 20, True) == "shm"
        assert pick(1024, True) == "mpi"          # below the cold run's sizes: the warm table
    finally:
        select.clear_cache()


def test_the_engine_chooses_for_cold_data():
    from allreduce.engine.engine import Engine
    from allreduce.transport.threads import ThreadWorld
    world = ThreadWorld(1)
    engine = Engine(world.transport(0))
    try:
        assert engine.comm.cold is True
    finally:
        engine.shutdown()


def test_scaling_rounds_report_each_methods_median_launch():
    """--scaling --rounds: a world size's launches become one record of medians, which goals.py reads."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "synthetic_benchmark.py"
    spec = importlib.util.spec_from_file_location("synthetic_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)                       # no TensorFlow at import time
    launches = [{"np": 2, "tfops": {"per_rank": t / 2, "total": t, "conf": c}, "local": {"per_rank": 1, "total": 2.0, "conf": 0}}
                for t, c in ((180.0, 3.0), (100.0, 9.0), (190.0, 1.0))]
    launches[1]["mwms"] = {"per_rank": 1, "total": 2.0, "conf": 0}   # only in one launch: left out
    row = bench._median_launch(launches)
    assert row["tfops"]["total"] == 180.0 and row["tfops"]["per_rank"] == 90.0 and row["tfops"]["conf"] == 3.0
    assert row["tfops"]["rounds"] == [180.0, 100.0, 190.0]
    assert "mwms" not in row and row["local"]["total"] == 2.0 and "barrier" not in row
    base = bench._median_launch([{"np": 1, "tfops": {"per_rank": v, "total": v, "conf": 0}} for v in (100.0, 90.0, 95.0)])
    assert goals.training_ratios({"runs": {"1": base, "2": row}})["efficiency"] == pytest.approx(180 / 190)
    args = bench.parse_args(["--scaling", "1,2", "--rounds", "3", "--barrier-baseline"])
    assert args.rounds == 3 and args.scaling == "1,2" and args.barrier_baseline
