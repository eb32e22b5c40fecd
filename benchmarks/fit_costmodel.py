"""Fit the cost model's alpha, beta, gamma per algorithm from benchmark JSON runs.

::

    mpirun -np 2 python benchmarks/allreduce_bench.py -b 8 -e 64M -f 4 --json run2.json
    python benchmarks/fit_costmodel.py run2.json [run4.json ...] [--out PATH] [--dry-run]

Every allreduce row gives one equation (select.py's model, n in bytes):

    T = a(p) alpha + b(p) n beta + g(p) n gamma        (a, b, g = select.terms(algorithm, p))

solved by least squares on the *relative* error (each row divided by its
measured T), because times span 10 us to 100 ms and an absolute fit would
ignore every small message. Constants are kept non-negative (an exact
search over which of them are zero; there are only three).

beta and gamma cannot be told apart by allreduce timings: for ring, tree,
rhd and mpi the ratio b(p)/g(p) is 2 at every p, so the columns ``b n``
and ``g n`` are proportional (for rd only p that are not powers of two
break the tie). So gamma is measured on its
own - the benchmark times ``kernels.reduce_into`` and stores it in the JSON
as ``gamma_s_per_byte`` - and only alpha and beta are fitted. Without it
(or with ``--gamma 0``) beta absorbs gamma: predictions are the same, only
the split differs. ``--fit-gamma`` fits all three when the runs make that
possible (rd at p = 3, 6, ... besides powers of two) and says so when not.

The result goes to ``select.default_path()`` (or ``--out``) in the format
``select.constants()`` reads: ``{"constants": {"ring": {"alpha": .., "beta": .., "gamma": ..}}}``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from allreduce.algorithms import select  # noqa: E402

__all__ = ["load_rows", "fit", "fit_algorithm", "predict", "write_constants"]

_NAMES = ("alpha", "beta", "gamma")


def load_rows(paths: list[str]) -> tuple[list[dict], float | None]:
    """Allreduce records of every file (with ``ranks`` filled in), and the median measured gamma."""
    rows, gammas = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data.get("gamma_s_per_byte"):
            gammas.append(float(data["gamma_s_per_byte"]))
        for record in data.get("records", []):
            if record.get("collective", "allreduce") == "allreduce":
                rows.append(dict(record, ranks=record.get("ranks", data.get("ranks")),
                                 cold=bool(data.get("cold_mib"))))
    return rows, (statistics.median(gammas) if gammas else None)


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, by trying every set of free variables (fine for 3 unknowns)."""
    best, best_res = np.zeros(A.shape[1]), float(np.sum(y ** 2))
    for k in range(1, A.shape[1] + 1):
        for free in itertools.combinations(range(A.shape[1]), k):
            sol, *_ = np.linalg.lstsq(A[:, free], y, rcond=None)
            if np.all(sol >= 0):
                x = np.zeros(A.shape[1])
                x[list(free)] = sol
                res = float(np.sum((A @ x - y) ** 2))
                if res < best_res:
                    best, best_res = x, res
    return best


def fit_algorithm(rows: list[dict], algorithm: str, *, gamma: float | None, fit_gamma: bool = False
                  ) -> dict[str, float]:
    """alpha, beta, gamma (seconds, s/byte, s/byte) for ``algorithm`` from its rows.

    Args:
        rows: records with ``size_bytes``, ``ranks``, ``time_us``.
        algorithm: a name ``select.terms`` knows.
        gamma: the measured reduction cost to hold fixed (None: 0, beta absorbs it).
        fit_gamma: fit gamma too; raises ``ValueError`` if the rows cannot separate it from beta.

    Returns:
        ``{"alpha": .., "beta": .., "gamma": ..}``.
    """
    design, times = [], []
    for r in rows:
        a, b, g = select.terms(algorithm, int(r["ranks"]), int(r["size_bytes"]))
        if a or b or g:
            n = float(r["size_bytes"])
            design.append((a, b * n, g * n))
            times.append(float(r["time_us"]) * 1e-6)
    if len(times) < 2:
        raise ValueError(f"{algorithm}: need at least 2 timed rows on p > 1 ranks, got {len(times)}")
    A, t = np.array(design), np.array(times)
    A, y = A / t[:, None], np.ones_like(t)          # relative error: divide each equation by its T
    if fit_gamma:
        scaled = A / np.maximum(np.abs(A).max(0), 1e-300)
        if np.linalg.matrix_rank(scaled, tol=1e-9) < 3:
            raise ValueError(f"{algorithm}: beta and gamma are collinear in these runs (b(p)/g(p) is the same "
                             "in every row); pass the measured gamma instead of --fit-gamma")
        return dict(zip(_NAMES, map(float, _nnls(A, y))))
    g = gamma or 0.0
    alpha, beta = _nnls(A[:, :2], y - A[:, 2] * g)
    return {"alpha": float(alpha), "beta": float(beta), "gamma": float(g)}


def fit(rows: list[dict], *, gamma: float | None, fit_gamma: bool = False) -> dict[str, dict[str, float]]:
    """Constants for every algorithm in ``rows`` that the cost model knows."""
    out = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        if algorithm not in select.DEFAULTS:
            continue
        mine = [r for r in rows if r["algorithm"] == algorithm]
        out[algorithm] = fit_algorithm(mine, algorithm, gamma=gamma, fit_gamma=fit_gamma)
    return out


def predict(constants: dict[str, float], algorithm: str, nbytes: int, p: int) -> float:
    """Seconds the fitted model predicts."""
    a, b, g = select.terms(algorithm, p, nbytes)
    return a * constants["alpha"] + b * nbytes * constants["beta"] + g * nbytes * constants["gamma"]


def measured_table(rows: list[dict], cold: bool = False) -> dict[str, list]:
    """``{p: [[size_bytes, {algorithm: time_us}], ...]}``: what ``select.choose`` picks from directly
    when the world size was measured (a straight line per algorithm misses cache effects: native
    MPI here is the fastest up to 4 MiB and the slowest at 64 MiB). ``cold``: from the
    ``--cold`` runs only (else from the others)."""
    table: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        if r["algorithm"] in select.DEFAULTS and int(r["ranks"]) > 1 and bool(r.get("cold")) == cold:
            row = table.setdefault(str(int(r["ranks"])), {}).setdefault(int(r["size_bytes"]), {})
            row[r["algorithm"]] = min(float(r["time_us"]), row.get(r["algorithm"], float("inf")))
    out = {}
    for p, sizes in table.items():
        # A size some run measured without every algorithm (a latency sweep beside a full one)
        # would hand that range back to the model: keep the sizes with all of them.
        every = set().union(*sizes.values())
        out[p] = [[size, times] for size, times in sorted(sizes.items()) if set(times) == every]
    return out


def write_constants(path: Path, constants: dict[str, dict[str, float]], sources: list[str],
                    measured: dict[str, list] | None = None, measured_cold: dict[str, list] | None = None) -> None:
    """Merge ``constants`` (and the measured tables, per world size) into the JSON file
    ``select.constants()`` reads (other algorithms and world sizes kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table, old_measured, old_cold = {}, {}, {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            table, old_measured, old_cold = old.get("constants", {}), old.get("measured", {}), \
                old.get("measured_cold", {})
        except ValueError:
            pass
    table.update(constants)
    old_measured.update(measured or {})
    old_cold.update(measured_cold or {})
    path.write_text(json.dumps({"constants": table, "measured": old_measured, "measured_cold": old_cold,
                                "sources": sources, "fitted_by": "benchmarks/fit_costmodel.py"}, indent=1) + "\n")


def report(rows: list[dict], constants: dict[str, dict[str, float]]) -> str:
    """Constants, then predicted vs measured for every row."""
    lines = [f"# {'algorithm':<10}{'alpha (us)':>12}{'beta (ns/B)':>13}{'gamma (ns/B)':>14}{'rms rel err':>13}"]
    detail = [f"# {'algorithm':<10}{'p':>4}{'size (B)':>12}{'measured (us)':>15}{'predicted (us)':>16}{'ratio':>8}"]
    for name, c in constants.items():
        errs = []
        for r in (r for r in rows if r["algorithm"] == name):
            pred = predict(c, name, int(r["size_bytes"]), int(r["ranks"])) * 1e6
            errs.append(pred / r["time_us"] - 1)
            detail.append(f"  {name:<10}{r['ranks']:>4}{r['size_bytes']:>12}{r['time_us']:>15.2f}{pred:>16.2f}"
                          f"{pred / r['time_us']:>8.2f}")
        rms = float(np.sqrt(np.mean(np.square(errs)))) if errs else float("nan")
        lines.append(f"  {name:<10}{c['alpha'] * 1e6:>12.3f}{c['beta'] * 1e9:>13.4f}{c['gamma'] * 1e9:>14.4f}"
                     f"{rms:>13.2f}")
    return "\n".join(lines + [""] + detail)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="fit alpha/beta/gamma per algorithm from benchmark JSON")
    parser.add_argument("runs", nargs="+", help="JSON files written by allreduce_bench.py --json")
    parser.add_argument("--out", default=None, help=f"constants file (default {select.default_path()})")
    parser.add_argument("--gamma", type=float, default=None, help="s/byte to hold fixed (default: from the runs)")
    parser.add_argument("--fit-gamma", action="store_true", help="fit gamma too (needs non-collinear runs)")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    parser.add_argument("--builtin", action="store_true",
                        help=f"also write the measured table to {select.BUILTIN.name}, the package's "
                             "stand-in for machines with no fit of their own (maintainers, after a "
                             "BENCHMARKS.md run)")
    args = parser.parse_args(argv)
    rows, measured = load_rows(args.runs)
    gamma = args.gamma if args.gamma is not None else measured
    warm = [r for r in rows if not r.get("cold")]              # the model's lines: warm runs only
    constants = fit(warm, gamma=gamma, fit_gamma=args.fit_gamma)
    if not constants:
        parser.error("no allreduce rows of a modelled algorithm (ring, tree, rhd, rd, mpi) in these runs")
    how = "fitted" if args.fit_gamma else (f"held at the measured {gamma * 1e9:.4f} ns/B" if gamma
                                           else "0 (beta absorbs the reduction cost)")
    print(f"# fit of T = a(p) alpha + b(p) n beta + g(p) n gamma over {len(warm)} rows; gamma {how}")
    print(report(warm, constants))
    if not args.dry_run:
        out = Path(args.out) if args.out else select.default_path()
        tables = measured_table(rows), measured_table(rows, cold=True)
        write_constants(out, constants, [os.path.abspath(p) for p in args.runs], *tables)
        print(f"# wrote {out}")
        if args.builtin:
            write_builtin(select.BUILTIN, *tables, args.runs)
            print(f"# wrote {select.BUILTIN}")
    return 0


def write_builtin(path: Path, measured: dict[str, list], measured_cold: dict[str, list], runs: list[str]) -> None:
    """The shipped table: measured times only (the model's constants stay in select.DEFAULTS)."""
    sources = [os.path.relpath(os.path.abspath(p), Path(__file__).resolve().parent.parent) for p in runs]
    path.write_text(json.dumps({"measured": measured, "measured_cold": measured_cold, "sources": sources,
                                "fitted_by": "benchmarks/fit_costmodel.py --builtin"}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
