"""Draw the course's figures (docs/figures/*.png) from the project's own code and recorded data.

    python docs/figures/make.py                    # every figure, into docs/figures
    python docs/figures/make.py --out /tmp/figs    # somewhere else (the docs test does this)
    python docs/figures/make.py --only ring-p4.png time-vs-size.png

Every picture comes from something the project computes or recorded:

* ``ps-vs-ring.png``: bytes through the busiest link per step, a parameter
  server against the ring (the counts of lesson 2);
* ``ring-p4.png``, ``rhd-p6.png``: ``allreduce-explain``'s drawing of the real
  algorithm run on thread ranks;
* ``double-tree.png``: the two trees ``binary_tree.double_binary_tree(8)`` builds;
* ``time-vs-size.png``: time against message size, the alpha-beta-gamma model
  (``select.predict``, DEFAULTS) beside the recorded -np 2 benchmark
  (``benchmarks/results/np2.json``), with the sizes where the fastest changes marked;
* ``timeline-hooks.png``, ``timeline-tape.png``: the overlap of backprop and
  allreduce, drawn from the timelines in docs/examples (lesson 9);
* ``lr-warmup.png``: the learning rate ``LearningRateWarmupCallback`` sets per
  batch (``tfops.training.lr_schedule.warmup_multiplier``), after Goyal et al. (2017).
* ``large-batch.png``: lesson 15's lab, test accuracy against global batch per
  method, from its recorded run (``allreduce-run -np 2 python examples/large_batch.py
  --quick --json docs/examples/large_batch.json``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COLORS = {"ring": "C0", "tree": "C1", "rhd": "C2", "rd": "C3", "mpi": "C4", "shm": "C5"}


def ps_vs_ring(out: Path) -> None:
    """Bytes per step through the busiest link, in units of the gradient size n."""
    p = np.arange(2, 65)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(p, 2 * p, label="parameter server: its link carries p·n in + p·n out")
    ax.plot(p, 2 * (p - 1), "--", label="naive allreduce: rank 0 receives and sends (p-1)·n")
    ax.plot(p, 2 * (p - 1) / p, label="ring: every link carries 2(p-1)/p·n (< 2n)")
    ax.set(xlabel="workers p", ylabel="bytes through the busiest link / n", yscale="log",
           title="Parameter server vs ring: traffic on the busiest link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def explained(algorithm: str, p: int, count: int):
    def draw(out: Path) -> None:
        from allreduce.explain import explain
        from allreduce.explain.draw import draw as draw_trace
        draw_trace(explain(algorithm, p, count), out)
    return draw


def double_tree(out: Path) -> None:
    """Tree 0 and its mirror for p = 8: interior ranks of one are leaves of the other."""
    from allreduce.algorithms.binary_tree import double_binary_tree
    trees = double_binary_tree(8)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for t, (ax, tree) in enumerate(zip(axes, trees)):
        depth = {tree.root: 0}
        order = [tree.root]
        for r in order:
            for c in tree.children[r]:
                depth[c] = depth[r] + 1
                order.append(c)
        xs = {r: (r if t == 0 else 7 - r) for r in order}          # in-order: x is the rank (mirrored)
        xs[tree.root] = xs[tree.children[tree.root][0]] - 1.2 if t == 0 else xs[tree.children[tree.root][0]] + 1.2
        for r in order:
            for c in tree.children[r]:
                top = r == tree.root
                ax.plot([xs[r], xs[c]], [-depth[r], -depth[c]], color="k", lw=3 if top else 1)
        for r in order:
            interior = bool(tree.children[r])
            ax.scatter(xs[r], -depth[r], s=420, color="C1" if interior else "white", edgecolors="k", zorder=3)
            ax.text(xs[r], -depth[r], str(r), ha="center", va="center", zorder=4)
        ax.set_title(f"tree {t}: root {tree.root}, carries the {'first' if t == 0 else 'second'} half", fontsize=9)
        ax.axis("off")
    fig.suptitle("Double binary tree, p = 8: orange = interior, white = leaf; thick edge = the top swap", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _crossovers(sizes, times: dict[str, list[float]]) -> list[tuple[float, str, str]]:
    """(size, before, after) wherever the fastest algorithm changes between two sizes."""
    best = [min(times, key=lambda a: times[a][i]) for i in range(len(sizes))]
    return [(math.sqrt(sizes[i - 1] * sizes[i]), best[i - 1], best[i])
            for i in range(1, len(sizes)) if best[i] != best[i - 1]]


def time_vs_size(out: Path) -> None:
    """Model (DEFAULTS) and the recorded -np 2 run, per algorithm, with the crossovers marked."""
    from allreduce.algorithms import select
    data = json.loads((ROOT / "benchmarks" / "results" / "np2.json").read_text())
    names = [a for a in COLORS if any(r["algorithm"] == a for r in data["records"])]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    grid = [int(x) for x in np.logspace(4, 26, 89, base=2)]
    model = {a: [select.predict(a, n, 2, path="/nonexistent/defaults.json") * 1e6 for n in grid] for a in names}
    measured: dict[str, dict[int, float]] = {a: {} for a in names}
    for r in data["records"]:
        if r["algorithm"] in measured:
            measured[r["algorithm"]][r["size_bytes"]] = r["time_us"]
    sizes = sorted(set.intersection(*(set(m) for m in measured.values())))
    panels = [(axes[0], grid, model, "model: select.predict, p = 2, select.DEFAULTS"),
              (axes[1], sizes, {a: [measured[a][n] for n in sizes] for a in names},
               "measured: benchmarks/results/np2.json (2 ranks, 2-core VM)")]
    for ax, xs, times, title in panels:
        for a in names:
            ax.plot(xs, times[a], "-" if xs is grid else "o-", ms=3, color=COLORS[a], label=a)
        for x, before, after in _crossovers(xs, times):
            ax.axvline(x, color="grey", ls=":", lw=1)
            ax.text(x, 0.97, f"{before}→{after}", rotation=90, va="top", ha="right", fontsize=7,
                    transform=ax.get_xaxis_transform())
        ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", title=title)
        ax.title.set_fontsize(9)
    axes[0].set_ylabel("time per allreduce (us)")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("Time against message size; dotted lines: where the fastest algorithm changes", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def timeline(name: str):
    def draw(out: Path) -> None:
        from allreduce.explain.timeline_png import load_timeline, render_timeline
        render_timeline(load_timeline(ROOT / "docs" / "examples" / f"timeline-{name}.json"), out,
                        title=f"{name}: backprop (submissions) and allreduce, last step, rank 0")
    return draw


def lr_warmup(out: Path) -> None:
    """The rate the warmup callback sets at every batch: initial_lr/p to initial_lr over 5 epochs."""
    from tfops.training.lr_schedule import warmup_multiplier
    steps, epochs, lr = 50, 8, 0.8
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for p in (1, 4, 8, 32):
        e = np.arange(epochs * steps) / steps
        rate = [lr * (warmup_multiplier(x + 1 / steps, p, 5) if x < 5 else 1.0) for x in e]   # as the callback
        ax.plot(e, rate, label=f"p = {p}: starts at {lr / p:g}")
    ax.axvline(5, color="grey", ls=":", lw=1)
    ax.set(xlabel="epoch", ylabel="learning rate", ylim=(0, lr * 1.1),
           title=f"warmup callback, initial_lr={lr}, warmup_epochs=5: from lr/p to lr")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def large_batch(out: Path) -> None:
    """Lesson 15: test accuracy against global batch per method, from the lab's recorded --quick run."""
    import runpy
    draw = runpy.run_path(str(ROOT / "examples" / "large_batch_plot.py"))["draw"]
    draw(json.loads((ROOT / "docs" / "examples" / "large_batch.json").read_text()), out)


FIGURES = {
    "ps-vs-ring.png": ps_vs_ring,
    "ring-p4.png": explained("ring", 4, 8),
    "rhd-p6.png": explained("rhd", 6, 8),
    "double-tree.png": double_tree,
    "time-vs-size.png": time_vs_size,
    "timeline-hooks.png": timeline("hooks"),
    "timeline-tape.png": timeline("tape"),
    "lr-warmup.png": lr_warmup,
    "large-batch.png": large_batch,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/figures/make.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="directory (default docs/figures)")
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="draw only these")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FIGURES:
        FIGURES[name](out / name)
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
