"""Predicted allreduce times from the alpha-beta-gamma model (allreduce/algorithms/select.py).

    python docs/examples/cost_table.py 8        # p = 8 ranks

    python docs/examples/cost_table.py 8 --fitted   # with this machine's fitted constants

Prints, per message size, each algorithm's predicted time in microseconds
and the one ``algorithm="auto"`` would pick. The constants are select.py's
DEFAULTS; with ``--fitted``, the ones benchmarks/fit_costmodel.py wrote for
this machine (if it has run here).
"""
import sys

from allreduce.algorithms import select

args = [a for a in sys.argv[1:] if not a.startswith("--")]
p = int(args[0]) if args else 8
path = "" if "--fitted" in sys.argv else "/nonexistent/use-the-defaults.json"
names = ("ring", "tree", "rhd", "rd")
print(f"p = {p}; predicted microseconds per allreduce")
print(f"{'bytes':>10}" + "".join(f"{n:>10}" for n in names) + "    auto picks")
for nbytes in (8, 1 << 10, 32 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20):
    times = [select.predict(n, nbytes, p, path=path) * 1e6 for n in names]
    print(f"{nbytes:>10}" + "".join(f"{t:>10.1f}" for t in times) + f"    {select.choose(nbytes, p, path=path)}")
for n in names:
    a, b, g = select.terms(n, p)
    print(f"{n:>5}: T = {a:g} alpha + {b:.3g} n beta + {g:.3g} n gamma")
