"""Draw lesson 15's figure from a record of examples/large_batch.py (no TensorFlow: docs/figures/make.py uses it).

    draw(json.load(open("docs/examples/large_batch.json")), "/tmp/large-batch.png")

The record: ``batches`` and ``steps`` (lists, one per global batch), ``accuracy`` (method name ->
one test accuracy per batch), ``epochs``, ``ranks``.
"""
from __future__ import annotations

STYLES = {"sgd": "o:", "linear": "s--", "warmup": "^-", "lars": "D-", "lamb": "v-"}


def draw(record: dict, path) -> None:
    """Test accuracy against global batch (log scale), one line per method; steps under each batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches, steps = record["batches"], record["steps"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, accuracy in record["accuracy"].items():
        ax.plot(batches, accuracy, STYLES.get(name, "x-"), label=name, lw=1.8, ms=6)
    ax.axhline(0.1, color="grey", lw=1, ls=":")
    ax.text(batches[0], 0.12, "guessing (10 classes)", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [f"{b}\n{s} steps" for b, s in zip(batches, steps)], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("global batch (and optimizer steps in the run)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left")
    ax.set_title(f"digits MLP, {record['epochs']} epochs at every batch, {record['ranks']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
