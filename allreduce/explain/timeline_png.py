"""Draw an engine timeline (``ALLREDUCE_TIMELINE``) as a PNG: one row per tensor, one colour per phase.

::

    ALLREDUCE_TIMELINE=/tmp/tl.json allreduce-run -np 2 python examples/synthetic_benchmark.py --mode hooks
    python -m allreduce.explain.timeline_png /tmp/tl.json --png timeline.png            # the last step
    python -m allreduce.explain.timeline_png /tmp/tl.json --png all.png --steps 0       # every step

The input is the Chrome-trace file :mod:`allreduce.engine.timeline` writes
(closed or still being written). Each tensor's spans are drawn in order:
QUEUE, NEGOTIATE, WAIT_FOR_BATCH, MEMCPY_IN_FUSION_BUFFER (or COMPRESS),
ALLREDUCE, MEMCPY_OUT_FUSION_BUFFER (or DECOMPRESS). The algorithm's phases
(reduce-scatter, allgather, ...) are thinner bars inside ALLREDUCE; ticks,
one colour per rank, are "rank r ready" during NEGOTIATE. A vertical line joins the rows of
one fused batch (one ALLREDUCE for all of them), and a dashed red line marks
the last submission of the step: with gradient hooks that is backprop
handing over its last gradient, so ALLREDUCE bars left of it overlap backprop.

A step is the k-th submission of each tensor (the k-th QUEUE span of its row).
Spans narrower than 0.2% of the window are widened so that they stay visible;
read exact durations in Perfetto (https://ui.perfetto.dev).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidArgumentError

__all__ = ["Span", "TimelineTrace", "load_timeline", "render_timeline", "main"]

#: The engine's stages, in order, and their colours; anything else nested in ALLREDUCE is an algorithm phase.
STAGES = {
    "QUEUE": "#c7c7c7",
    "NEGOTIATE": "#ffbb78",
    "WAIT_FOR_BATCH": "#f7e08c",
    "MEMCPY_IN_FUSION_BUFFER": "#98df8a",
    "COMPRESS": "#2ca02c",
    "ALLREDUCE": "#aec7e8",
    "MEMCPY_OUT_FUSION_BUFFER": "#c5b0d5",
    "DECOMPRESS": "#9467bd",
}
_TICK_COLOURS = ["black", "#e6550d", "#3182bd", "#31a354", "#756bb1", "#636363", "#a63603", "#08519c"]
_PHASE_COLOURS = ["#1f77b4", "#d62728", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#7f7f7f", "#ff7f0e"]


@dataclass
class Span:
    """One complete event (``ph: X``) on a tensor's row; times in microseconds."""
    row: str
    name: str
    start: float
    dur: float
    args: dict = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclass
class TimelineTrace:
    """A parsed timeline: rows in order of first appearance, spans, and ``(row, label, ts)`` ticks."""
    path: str
    rank: int
    rows: list[str]
    spans: list[Span]
    ticks: list[tuple[str, str, float]]

    def submissions(self) -> list[list[float]]:
        """Submit times per step: ``[step][i]`` is the start of the step-th QUEUE span of a row.

        Only rows submitted in every step count (a tensor reduced once, say a
        broadcast, does not cut the run into steps).
        """
        queued: dict[str, list[float]] = {}
        for s in self.spans:
            if s.name == "QUEUE":
                queued.setdefault(s.row, []).append(s.start)
        if not queued:
            return []
        steps = max(len(t) for t in queued.values())
        full = [sorted(t) for t in queued.values() if len(t) == steps]
        return [[t[k] for t in full] for k in range(steps)]


def load_timeline(path: str | Path) -> TimelineTrace:
    """Read a timeline JSON file written by :class:`allreduce.engine.timeline.Timeline`.

    Args:
        path: the file (rank 0's path, or a ``.rank<r>.json`` one); it may lack its closing ``]``.

    Returns:
        The parsed :class:`TimelineTrace`.

    Raises:
        InvalidArgumentError: the file is missing, is not a Chrome-trace event list, or has no spans.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read timeline {str(p)!r}: {exc.strerror or exc}") from None
    try:
        events = json.loads(text)
    except ValueError:                          # still being written: one event per line, no closing ']'
        try:
            events = [json.loads(line.rstrip().rstrip(",")) for line in text.splitlines()
                      if line.startswith("{")] or None
        except ValueError:
            events = None
    if isinstance(events, dict):
        events = events.get("traceEvents")
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise InvalidArgumentError(f"{str(p)!r} is not a timeline: expected a JSON list of trace events "
                                   "as written with ALLREDUCE_TIMELINE=path")
    names = {e.get("tid"): e.get("args", {}).get("name", "") for e in events if e.get("name") == "thread_name"}
    rank = next((e.get("pid", 0) for e in events if e.get("name") == "process_name"), 0)
    rows: list[str] = []
    spans: list[Span] = []
    ticks: list[tuple[str, str, float]] = []
    for e in events:
        if e.get("ph") not in ("X", "i") or "ts" not in e:
            continue
        row = names.get(e.get("tid")) or f"tid {e.get('tid')}"
        if row not in rows:
            rows.append(row)
        if e["ph"] == "X":
            spans.append(Span(row, str(e.get("name")), float(e["ts"]), float(e.get("dur", 0.0)), e.get("args") or {}))
        else:
            ticks.append((row, str(e.get("name")), float(e["ts"])))
    if not spans:
        raise InvalidArgumentError(f"timeline {str(p)!r} holds no spans: did the run submit any tensor?")
    return TimelineTrace(str(p), int(rank), rows, spans, ticks)


def _window(trace: TimelineTrace, steps: int) -> tuple[float, float, list[list[float]]]:
    """``(start, end, shown steps' submit times)`` for the last ``steps`` steps (0: all)."""
    subs = trace.submissions()
    shown = subs[-steps:] if steps and subs else subs
    start = min(shown[0]) if shown else min(s.start for s in trace.spans)
    end = max(s.end for s in trace.spans if s.end >= start)
    return start, end, shown


def _overlap_line(trace: TimelineTrace, start: float, last_submit: float) -> str:
    """"k of n allreduces started before the last submission" for the last shown step."""
    first = {}
    for s in trace.spans:
        if s.name == "ALLREDUCE" and s.start >= start and s.row not in first:
            first[s.row] = s.start
    batches = len(set(first.values()))
    early = sum(t < last_submit for t in first.values())
    return (f"last step: {len(first)} tensors reduced in {batches} allreduce(s); "
            f"{early} of {len(first)} started before the last submission")


def render_timeline(trace: TimelineTrace, png: str | Path, *, steps: int = 1, title: str | None = None) -> str:
    """Draw ``trace`` to ``png``.

    Args:
        trace: from :func:`load_timeline`.
        png: output path.
        steps: how many of the last steps to show (0: the whole run).
        title: the figure's title (default: the file name and rank).

    Returns:
        A one-line summary of the last shown step (fusion and overlap).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if steps < 0:
        raise InvalidArgumentError(f"steps must be >= 0 (0: the whole run), got {steps}")
    t0, t1, shown = _window(trace, steps)
    ms = lambda t: (t - t0) / 1e3                                       # noqa: E731
    spans = [s for s in trace.spans if s.end >= t0]
    rows = [r for r in trace.rows if any(s.row == r for s in spans)]
    y = {r: i for i, r in enumerate(rows)}
    phases = sorted({s.name for s in spans if s.name not in STAGES})
    colours = dict(STAGES, **{p: _PHASE_COLOURS[i % len(_PHASE_COLOURS)] for i, p in enumerate(phases)})

    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.42 * len(rows)))
    least = 0.002 * ms(t1)                           # narrower spans are widened to stay visible
    for s in spans:                                   # engine stages: full-height bars
        if s.name in STAGES:
            ax.broken_barh([(ms(s.start), max(s.dur / 1e3, least))], (y[s.row] - 0.38, 0.76),
                           facecolors=colours[s.name], edgecolor="none")
    for s in spans:                                   # algorithm phases: thin bars inside ALLREDUCE
        if s.name not in STAGES:
            ax.broken_barh([(ms(s.start), max(s.dur / 1e3, least))], (y[s.row] - 0.05, 0.38),
                           facecolors=colours[s.name], edgecolor="none")
    batches: dict[float, list[int]] = {}
    for s in spans:                                   # one ALLREDUCE start shared by several rows = fused
        if s.name == "ALLREDUCE":
            batches.setdefault(s.start, []).append(y[s.row])
    for start, ys in batches.items():
        if len(ys) > 1:
            ax.plot([ms(start)] * 2, [min(ys) - 0.4, max(ys) + 0.4], color="black", lw=1.2)
    ticks: dict[str, list[tuple[float, int]]] = {}
    for row, label, t in trace.ticks:                 # "rank r ready": one colour per rank
        if t >= t0 and row in y:
            ticks.setdefault(label, []).append((ms(t), y[row]))
    by_rank = sorted(ticks, key=lambda label: (len(label), label))      # rank 2 before rank 10
    tick_colours = {label: _TICK_COLOURS[i % len(_TICK_COLOURS)] for i, label in enumerate(by_rank)}
    for label, points in ticks.items():
        ax.plot([x for x, _ in points], [r - 0.25 for _, r in points], linestyle="none", marker="|",
                markersize=8, markeredgewidth=1.6, color=tick_colours[label])
    for subs in shown:
        ax.axvline(ms(max(subs)), color="#d62728", linestyle="--", lw=1.3)

    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)               # first row on top
    ax.set_xlim(-0.01 * ms(t1), ms(t1) * 1.01)
    ax.set_xlabel("ms since the first submission of the shown step(s)")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    summary = _overlap_line(trace, min(shown[-1]), max(shown[-1])) if shown else \
        f"{len(rows)} tensors; no QUEUE spans, so no steps"
    ax.set_title((title or f"{Path(trace.path).name} (rank {trace.rank})") + "\n" + summary, fontsize=10)
    handles = [Patch(color=colours[n], label=n) for n in colours if any(s.name == n for s in spans)]
    handles += [Line2D([], [], color="black", lw=1.2, label="fused batch (one ALLREDUCE)"),
                *[Line2D([], [], color=c, marker="|", markeredgewidth=1.6, linestyle="none", label=label)
                  for label, c in list(tick_colours.items())[:8]],
                Line2D([], [], color="#d62728", linestyle="--", label="last submission of a step")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1 + 0.26 * len(rows))),
              ncol=4, fontsize=8, frameon=False)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m allreduce.explain.timeline_png TRACE.json --png OUT.png [--steps N]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m allreduce.explain.timeline_png",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="timeline JSON written with ALLREDUCE_TIMELINE=path")
    parser.add_argument("--png", required=True, help="output image")
    parser.add_argument("--steps", type=int, default=1, help="last N steps to draw; 0 = the whole run (default 1)")
    parser.add_argument("--title", help="figure title (default: file name and rank)")
    args = parser.parse_args(argv)
    try:
        summary = render_timeline(load_timeline(args.trace), args.png, steps=args.steps, title=args.title)
    except InvalidArgumentError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.png}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
