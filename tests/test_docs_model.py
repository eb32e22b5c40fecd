"""Lesson 3's numbers and the course's figures: the printed cost-model terms reproduce their table,
allreduce-explain prints the model ``auto`` uses, and docs/figures/make.py draws (fast ones here)."""
from __future__ import annotations

import contextlib
import io
import re
import runpy

import pytest

from tests.test_docs import DOCS, ROOT, default_costmodel, run  # noqa: F401  (default_costmodel: a fixture)

def _cost_table(argv: list[str]) -> list[str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_path(str(DOCS / "examples" / "cost_table.py"), run_name="cost_table")["main"](argv)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("p", [3, 4, 8, 16])
def test_cost_table_terms_reproduce_its_rows(p: int, default_costmodel):
    """Lesson 3: every row of cost_table.py is its printed terms evaluated with its printed constants."""
    lines = _cost_table([str(p)])
    names = lines[1].split()[1:-2]
    rows = {int(line.split()[0]): [float(x) for x in line.split()[1:1 + len(names)]] for line in lines[2:]
            if line.split()[0].isdigit()}
    formulas: dict[str, list[tuple[tuple[float, ...], list[str]]]] = {}
    for line in lines:
        if m := re.match(r"\s*(\w+): alpha = (\S+) us, beta = (\S+) ns/B, gamma = (\S+) ns/B", line):
            name, consts = m.group(1), (float(m.group(2)) * 1e-6, float(m.group(3)) * 1e-9, float(m.group(4)) * 1e-9)
            formulas[name] = []
        elif m := re.match(r"\s*T = (\S+) alpha \+ (\S+) n beta \+ (\S+) n gamma(?:   at (.*))?$", line):
            terms = tuple(float(x) for x in m.groups()[:3])
            formulas[name].append((terms + consts, m.group(4).split(", ") if m.group(4) else []))
    assert sorted(formulas) == sorted(names)

    def label(n: int) -> str:
        for unit, shift in (("MiB", 20), ("KiB", 10)):
            if n >= 1 << shift and n % (1 << shift) == 0:
                return f"{n >> shift} {unit}"
        return f"{n} B"
    for nbytes, times in rows.items():
        for name, shown in zip(names, times):
            (a, b, g, alpha, beta, gamma), = [f for f, at in formulas[name] if not at or label(nbytes) in at]
            assert a * alpha + b * nbytes * beta + g * nbytes * gamma == pytest.approx(shown * 1e-6, rel=1e-5, abs=0.06e-6), \
                (p, name, nbytes)


def test_explain_prints_the_model_auto_uses(default_costmodel):
    """allreduce-explain's model line is select.predict's time at the run's size (tree, p = 8, one segment)."""
    from allreduce.algorithms import select
    code, got = run("allreduce-explain tree --ranks 8 --count 64", ROOT)
    model = next(line for line in got if line.strip().startswith("model"))
    assert float(model.split("=")[-1].split()[0]) == pytest.approx(select.predict("tree", 512, 8) * 1e6, abs=0.01)


def test_figures_script_draws_every_figure_fast(tmp_path):
    """docs/figures/make.py draws its figures into a scratch folder (lr-warmup imports TensorFlow: --slow)."""
    make = runpy.run_path(str(DOCS / "figures" / "make.py"), run_name="figures")
    fast = [name for name in make["FIGURES"] if name != "lr-warmup.png"]
    assert make["main"](["--out", str(tmp_path), "--only", *fast]) == 0
    for name in fast:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (DOCS / "figures" / name).is_file(), f"{name} is not checked in: python docs/figures/make.py"

