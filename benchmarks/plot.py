"""Benchmark JSON -> PNG: bus bandwidth against size, and latency at small sizes.

::

    python benchmarks/plot.py run2.json [--out run2.png] [--small 65536]

Left: busbw (GB/s) against message size (log x), one line per algorithm or
peer, with the memory-bandwidth bound of an allreduce on this machine drawn
as a dashed line (B_mem / (2p), in busbw units). Right: time per call
(log-log) for messages up to ``--small`` bytes, where latency dominates.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

__all__ = ["plot_run"]


def _series(records: list[dict]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for r in records:
        series.setdefault(r["algorithm"], []).append(r)
    return {k: sorted(v, key=lambda r: r["size_bytes"]) for k, v in series.items()}


def plot_run(data: dict, out: str | Path, *, small: int = 64 << 10) -> Path:
    """Draw one benchmark run (the dict ``--json`` wrote) into the PNG ``out``.

    Args:
        data: the JSON of one allreduce_bench.py run.
        out: where to write the PNG.
        small: largest size (bytes) in the latency panel.

    Returns:
        The path written.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(data["records"])
    p, collective = data["ranks"], data["collective"]
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, rows in series.items():
        style = "--" if name in ("mpi4py", "gloo", "horovod") else "-"
        bw.plot([r["size_bytes"] for r in rows], [r["busbw_gbps"] for r in rows], style, marker="o", ms=3,
                label=name)
        few = [r for r in rows if r["size_bytes"] <= small]
        if few:
            lat.plot([r["size_bytes"] for r in few], [r["time_us"] for r in few], style, marker="o", ms=3,
                     label=name)
    if data.get("bound_algbw_gbps"):
        bound = data["bound_algbw_gbps"] * common.bus_factor(collective, p)
        bw.axhline(bound, color="k", ls=":", lw=1.2, label=f"bound B_mem/(2p)\n= {bound:.2f} GB/s busbw")
    bw.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)",
           title=f"{collective}, {data['dtype']}, {data['op']}, {p} ranks: bus bandwidth")
    lat.set(xscale="log", yscale="log", xlabel="size (bytes)", ylabel="time per call (us)",
            title=f"latency, sizes <= {common.human_size(small)}")
    for ax in (bw, lat):
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = bw.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)      # one legend, outside both panels
    command = textwrap.fill(data.get("command", ""), 170)
    fig.text(0.01, 0.01, command, fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.03 * (1 + command.count("\n")), 0.85, 1))
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="plot allreduce_bench.py --json runs")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", default=None, help="PNG path (one run only; default: the JSON name .png)")
    parser.add_argument("--small", type=common.parse_size, default=64 << 10, help="latency panel up to this size")
    args = parser.parse_args(argv)
    if args.out and len(args.runs) > 1:
        parser.error("--out takes one run; omit it to write <run>.png next to each JSON")
    for run in args.runs:
        out = args.out or str(Path(run).with_suffix(".png"))
        print(plot_run(json.loads(Path(run).read_text()), out, small=args.small))
    return 0


if __name__ == "__main__":
    sys.exit(main())
