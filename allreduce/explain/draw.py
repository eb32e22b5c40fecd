"""Draw a :class:`~allreduce.explain.symbolic.Trace` as a grid: ranks are rows, steps are columns.

Each cell is one rank's buffer after that step, cut into its chunks; a
chunk's colour says how many ranks' contributions it holds (white: none,
darkest: all p), and its text names them (``ab`` = ranks 0 and 1). An
arrow from column i to column i+1 is a message of step i+1, labelled with
the chunks it carries.

    allreduce-explain ring --ranks 4 --count 8 --png ring4.png
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .symbolic import Trace

__all__ = ["draw"]

_W, _GAP, _H = 1.3, 0.9, 0.62      # cell width, gap between columns, cell height (row pitch 1)


def _short(mask: int) -> str:
    return "".join(chr(ord("a") + r) for r in range(mask.bit_length()) if mask >> r & 1)


def draw(trace: Trace, path: str | Path) -> None:
    """Write the figure to ``path``; the format follows the suffix (``.png``, ``.svg``, ``.pdf``).

    Args:
        trace: the result of :func:`~allreduce.explain.symbolic.explain`.
        path: output file.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm
    from matplotlib.patches import Rectangle

    p, ncol = trace.p, len(trace.states)
    titles = ["start"] + [f"{ph} {st}" for ph, st in trace.steps]
    if len(titles) < ncol:
        titles.append("end")
    cmap = colormaps["YlGnBu"]
    norm = BoundaryNorm(np.arange(0.5, p + 1.5), cmap.N)
    fig, ax = plt.subplots(figsize=(1.2 + (_W + _GAP) * ncol, 0.9 + 0.75 * p))
    weights = np.array([max(n, 1) for _, n in trace.atoms], float)
    widths = _W * weights / weights.sum() if weights.size else weights
    # A chunk is about 72 * width points wide; p letters of a font of size f take about 0.6 p f points.
    fontsize = max(3.5, min(9.0, 72 * _W / max(1, len(trace.atoms)) / (0.8 * p)))

    for col in range(ncol):
        x0 = col * (_W + _GAP)
        ax.text(x0 + _W / 2, 0.55, titles[col], ha="center", va="bottom", fontsize=8)
        for r in range(p):
            y = -r - _H / 2
            x = x0
            for j, mask in enumerate(trace.atom_masks(trace.states[col][r])):
                k = bin(mask).count("1")
                face = cmap(norm(k)) if k else (1, 1, 1, 1)
                ax.add_patch(Rectangle((x, y), widths[j], _H, facecolor=face, edgecolor="0.4", lw=0.5))
                if k:
                    ax.text(x + widths[j] / 2, -r, _short(mask), ha="center", va="center",
                            fontsize=fontsize, color="white" if k > p / 2 else "black")
                x += widths[j]
            if not trace.atoms:
                ax.add_patch(Rectangle((x0, y), _W, _H, facecolor="none", edgecolor="0.4", lw=0.5))
    for i, msgs in enumerate(trace.step_messages):
        x_from, x_to = i * (_W + _GAP) + _W, (i + 1) * (_W + _GAP)
        for m in msgs:
            ax.annotate("", xy=(x_to, -m.dst), xytext=(x_from, -m.src),
                        arrowprops=dict(arrowstyle="->", color="C3", lw=0.8, alpha=0.8))
            label = _label(trace, m)
            if label:                            # a fifth of the way along its arrow, so labels part
                ax.text(x_from + 0.2 * (x_to - x_from), -m.src - 0.2 * (m.dst - m.src) + 0.08, label,
                        fontsize=6, color="C3", va="bottom")
    for r in range(p):
        ax.text(-0.15, -r, f"rank {r}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.0, ncol * (_W + _GAP) - _GAP + 0.1)
    ax.set_ylim(-p + 0.3, 1.1)
    ax.axis("off")
    ax.set_title(f"{trace.algorithm} {trace.collective}, p = {p}, {trace.count} elements: "
                 "colour = ranks summed, arrows = messages", fontsize=9)
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    bar = fig.colorbar(sm, ax=ax, fraction=0.02, pad=0.01, ticks=range(1, p + 1))
    bar.set_label("contributions held", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    fig.savefig(str(path), dpi=110, bbox_inches="tight", metadata=_metadata(str(path)))
    plt.close(fig)


def _label(trace: Trace, m) -> str:
    """The chunks a message carries, from where it sits in the sender's or receiver's buffer."""
    loc = next((loc for loc in (m.src_loc, m.dst_loc) if loc and loc[0] == "buf"), None)
    if loc is None or not m.data.size:
        return ""
    return ",".join(lab for (a, n), lab in zip(trace.atoms, trace.labels)
                    if n and loc[1] <= a and a + n <= loc[1] + loc[2])


def _metadata(path: str) -> dict:
    """No dates in the files, so regenerating a figure gives the same bytes."""
    if path.endswith(".svg"):
        return {"Date": None}
    if path.endswith(".pdf"):
        return {"CreationDate": None}
    return {}
