"""Predicted allreduce times from the alpha-beta-gamma model (allreduce/algorithms/select.py).

    python docs/examples/cost_table.py 8                     # p = 8 ranks
    python docs/examples/cost_table.py 8 --bytes 1000 2000   # at these sizes instead
    python docs/examples/cost_table.py 8 --algorithms ring,tree
    python docs/examples/cost_table.py 8 --fitted            # this machine's fitted constants

Prints, per message size, each algorithm's predicted time in microseconds
(``select.predict``) and the one the model picks, then each algorithm's terms
``a alpha + b n beta + g n gamma`` (``select.terms``) and constants: evaluating
a term line at a row's n gives that row's number. The tree's terms change with
n (its pipeline has one more stage up and down per segment), so it gets a line
per size. The constants are select.py's DEFAULTS; with ``--fitted``, the ones
benchmarks/fit_costmodel.py wrote for this machine (if it has run here).
"""
import sys

from allreduce.algorithms import select

NAMES = ("ring", "tree", "rhd", "rd")
SIZES = (8, 1 << 10, 32 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20)


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _terms(a: float, b: float, g: float) -> str:
    return f"T = {a:g} alpha + {b:.6g} n beta + {g:.6g} n gamma"


def main(argv: list[str]) -> None:
    words = [a for a in argv if a != "--fitted"]
    names = NAMES
    if "--algorithms" in words:
        i = words.index("--algorithms")
        names = tuple(words[i + 1].split(","))
        words = words[:i] + words[i + 2:]
    sizes = [int(a) for a in words[words.index("--bytes") + 1:]] if "--bytes" in words else list(SIZES)
    words = words[:words.index("--bytes")] if "--bytes" in words else words
    p = int(words[0]) if words else 8
    path = "" if "--fitted" in argv else "/nonexistent/use-the-defaults.json"
    print(f"p = {p}; predicted microseconds per allreduce")
    print(f"{'bytes':>10}" + "".join(f"{n:>10}" for n in names) + "    model picks")
    for nbytes in sizes:
        times = [select.predict(n, nbytes, p, path=path) * 1e6 for n in names]
        pick = select.choose(nbytes, p, candidates=names, path=path)
        print(f"{nbytes:>10}" + "".join(f"{t:>10.1f}" for t in times) + f"    {pick}")
    table = select.constants(path)
    for name in names:
        c = table[name]
        print(f"{name:>5}: alpha = {c['alpha'] * 1e6:g} us, beta = {c['beta'] * 1e9:g} ns/B, "
              f"gamma = {c['gamma'] * 1e9:g} ns/B")
        lines: dict[str, list[str]] = {}
        for nbytes in sizes:
            lines.setdefault(_terms(*select.terms(name, p, nbytes)), []).append(_size(nbytes))
        for formula, at in lines.items():
            where = "" if len(lines) == 1 else f"   at {', '.join(at)}"
            print(f"       {formula}{where}")


if __name__ == "__main__":
    main(sys.argv[1:])
