"""The printed explanation: for each step, the messages and every rank's chunks; then the totals
and the alpha-beta-gamma cost evaluated with them."""
from __future__ import annotations

import numpy as np

from ..algorithms import select
from .recorder import Message
from .symbolic import Trace, letters, model_terms

__all__ = ["render", "totals", "message_text"]


def _chunk_range(trace: Trace, off: int, n: int) -> list[int]:
    """Indices of the chunks that the element range ``[off, off + n)`` covers."""
    return [i for i, (a, m) in enumerate(trace.atoms) if m and off <= a and a + m <= off + n]


def _names(trace: Trace, idx: list[int]) -> str:
    labels = [trace.labels[i] for i in idx]
    if len(idx) > 2 and idx == list(range(idx[0], idx[-1] + 1)):
        return f"chunks {labels[0]}-{labels[-1]}"
    return ("chunk " if len(idx) == 1 else "chunks ") + ",".join(labels)


def message_text(trace: Trace, m: Message) -> str:
    """``"0 -> 1  chunk 3  a3+d3"``: who sends what, and what it holds."""
    head = f"{m.src} -> {m.dst}"
    loc = next((loc for loc in (m.src_loc, m.dst_loc) if loc and loc[0] == "buf"), None)
    if m.data.size == 0:
        return f"{head}  (empty)"
    idx = _chunk_range(trace, loc[1], loc[2]) if loc else []
    if not idx:                                 # scratch to scratch: say what it holds
        return f"{head}  {m.data.size} elements from scratch  " + \
            " | ".join(letters(int(v)) for v in dict.fromkeys(m.data.tolist()))
    parts = []
    for i in idx:
        a, n = trace.atoms[i]
        vals = dict.fromkeys(m.data[a - loc[1]:a - loc[1] + n].tolist())
        parts.append(" | ".join(letters(int(v), trace.labels[i]) for v in vals))
    where = "" if loc is m.src_loc else "  (from the send buffer)" if trace.collective == "alltoall" \
        else "  (from scratch)"
    return f"{head}  {_names(trace, idx)}  {', '.join(parts)}{where}"


def _table(trace: Trace, i: int, style: str = "table") -> list[str]:
    cells = [[letters(mask, trace.labels[j]) for j, mask in enumerate(trace.atom_masks(trace.states[i][r]))]
             for r in range(trace.p)]
    if style == "lines":                        # one line per rank and chunk: "rank 2 chunk 1: a1+b1+c1"
        return [f"  rank {r} chunk {lab}: {cell}" for r, row in enumerate(cells)
                for lab, cell in zip(trace.labels, row)]
    if not trace.atoms:
        return ["  (empty buffer)"]
    heads = [f"chunk {lab}" for lab in trace.labels]
    widths = [max([len(h)] + [len(row[j]) for row in cells]) for j, h in enumerate(heads)]
    lines = ["           " + "  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()]
    for r, row in enumerate(cells):
        lines.append(f"  rank {r:<3} " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return lines


def totals(trace: Trace) -> list[tuple[int, int, int]]:
    """Per rank: ``(messages sent, bytes sent, bytes reduced)``."""
    out = []
    for r in range(trace.p):
        sent = [m for m in trace.recording.messages if m.src == r and m.data.size]
        reduced = sum(red.nbytes for red in trace.recording.reductions if red.rank == r)
        out.append((len(sent), sum(m.data.nbytes for m in sent), reduced))
    return out


def _critical_path(trace: Trace) -> tuple[int, int]:
    """Bytes sent and reduced along the steps: per step the busiest rank's, summed over steps."""
    index = {k: i for i, k in enumerate(trace.steps)}
    sent = np.zeros((len(trace.steps), trace.p), np.int64)
    reduced = np.zeros_like(sent)
    for i, msgs in enumerate(trace.step_messages):
        for m in msgs:
            sent[i, m.src] += m.data.nbytes
    for red in trace.recording.reductions:
        reduced[index.get(red.key, 0), red.rank] += red.nbytes
    return int(sent.max(1).sum()) if sent.size else 0, int(reduced.max(1).sum()) if reduced.size else 0


def _cost(trace: Trace, rows: list[tuple[int, int, int]]) -> list[str]:
    n = trace.count * 8
    which = trace.algorithm if trace.collective == "allreduce" else "ring"
    try:
        c = select.constants()[which]
        a, b, g = model_terms(trace.collective, trace.algorithm, trace.p, n, trace.segment_bytes)
    except (KeyError, ValueError):
        return [f"cost model: select.py has no alpha-beta-gamma terms for {trace.algorithm!r} "
                "(see the cost in its module docstring)"]
    steps = max((m.depth for m in trace.recording.messages), default=0)
    mb, mg = (x / n if n else 0.0 for x in _critical_path(trace))
    source = f"select.terms({trace.algorithm!r}, {trace.p}, n)" if trace.collective == "allreduce" \
        else f"the {trace.collective} module docstring"
    lines = [f"cost model, n = {n} bytes; terms from {source}; constants select.constants()[{which!r}]: "
             f"alpha = {c['alpha'] * 1e6:g} us, beta = {c['beta'] * 1e9:g} ns/B, gamma = {c['gamma'] * 1e9:g} ns/B"]
    for name, (x, y, z) in (("model", (a, b, g)), ("this run", (steps, mb, mg))):
        t = x * c["alpha"] + y * n * c["beta"] + z * n * c["gamma"]
        lines.append(f"  {name:<9} T = {x:g} alpha + {y:.4g} n beta + {z:.4g} n gamma = {t * 1e6:.2f} us")
    lines.append("  (this run: alpha counts the longest chain of messages, each sent after the previous "
                 "one arrived;\n   beta and gamma: per step the most bytes one rank sends and reduces, "
                 "summed over the steps, / n)")
    return lines


def render(trace: Trace, style: str = "table") -> str:
    """The whole explanation as text.

    Args:
        trace: the result of :func:`~allreduce.explain.symbolic.explain`.
        style: ``"table"`` (ranks x chunks after each step) or ``"lines"`` (one line per rank and chunk).

    Returns:
        The printout, ending with a newline.
    """
    p, count = trace.p, trace.count
    head = f"{trace.algorithm} {trace.collective}, {p} ranks, {count} int64 elements ({count * 8} bytes)"
    legend = "  ".join(f"{lab}=[{a},{a + n})" for lab, (a, n) in zip(trace.labels, trace.atoms))
    out = [head,
           "letters are ranks (a = rank 0, b = rank 1, ...), digits are chunks: a1+b1 is chunk 1 "
           "summed over ranks 0 and 1",
           f"chunks (element ranges): {legend or '(none)'}"]
    if trace.collective == "alltoall":
        out.insert(2, "the tables show each rank's receive buffer: chunk j there is rank j's block for "
                      "that rank (c2 on rank 1 = what rank 2 sent rank 1)")
    if any(len({m.depth for m in msgs}) > 1 for msgs in trace.step_messages):
        out.append("a step in rounds: a rank sent round k's messages after a message of round k-1 reached it")
    out += ["", "start"]
    out += _table(trace, 0, style)
    for i, (phase, step) in enumerate(trace.steps):
        out += ["", f"{phase} {step}"]
        msgs = sorted(trace.step_messages[i], key=lambda m: (m.depth, m.src, m.dst))
        rounds = sorted({m.depth for m in msgs})
        for m in msgs:
            if len(rounds) > 1 and (m is msgs[0] or m.depth != prev):
                out.append(f"  round {rounds.index(m.depth) + 1} of {len(rounds)}:")
            prev = m.depth
            out.append("  " + message_text(trace, m))
        out += _table(trace, i + 1, style)
    if not trace.steps:
        out += ["", "end (no step was marked and no message was sent)"] + _table(trace, 1, style)
    if trace.steps and not trace.recording.messages:
        out += ["", "(no messages: the ranks read each other's memory directly, which no transport sees)"]
    rows = totals(trace)
    out += ["", "totals    messages  bytes sent  bytes reduced"]
    out += [f"  rank {r:<3} {m:>8}  {s:>10}  {d:>13}" for r, (m, s, d) in enumerate(rows)]
    out += [""] + _cost(trace, rows) + [""]
    errors = trace.errors()
    out += errors or [f"check: every rank ends with what {trace.collective} promises, "
                      "and no contribution was counted twice"]
    return "\n".join(out) + "\n"
