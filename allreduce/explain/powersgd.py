"""``allreduce-explain powersgd``: PowerSGD's steps on thread ranks, with a small matrix, in numbers.

Examples::

    allreduce-explain powersgd --ranks 2 --rows 4 --cols 3 --rank 1
    allreduce-explain powersgd --ranks 3 --rows 6 --cols 5 --rank 2 --steps 20

Each thread rank holds its own integer matrix ``M_i`` and runs the real hook
(:class:`~allreduce.engine.powersgd.PowerSGD`) over a ring allreduce on the
in-process transport. The explainer records every allreduce the hook makes
(its input on each rank and its result) and prints, for the first step: M,
Q, each rank's ``P_i = M_i Q``, the allreduce of the P's, P orthonormalised,
each ``Q_i = M_i^T P``, the allreduce of the Q's, the approximation
``P Q^T`` against the true average, and the error each rank carries to the
next step. With ``--steps N`` it then prints one line per step: this step's
error and the error of the mean of the outputs so far, which error feedback
drives toward zero.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .. import algorithms
from ..buffers import Workspace
from ..engine.hooks import Bucket, HookComm
from ..engine.powersgd import EPSILON, PowerSGD, orthonormalise
from ..ops import Op
from ..transport.threads import run_threads

__all__ = ["main", "run"]

_NAME = "layer/w"


class _Recording:
    """The hook's allreduces, run with ring on the thread transport and recorded (input, result)."""

    def __init__(self, transport):
        self.transport, self.workspace, self.calls = transport, Workspace(), []

    def allreduce(self, buf: np.ndarray, op: Op) -> str:
        before = buf.copy()
        algorithms.run("ring", self.transport, buf, op, workspace=self.workspace, segment_bytes=0)
        self.calls.append((before, buf.copy()))
        return "ring"


def _rank_body(transport, matrices, hook, steps):
    """One thread rank: ``steps`` reductions of its matrix; returns (recorded calls, outputs, errors)."""
    recorder = _Recording(transport)
    comm = HookComm(transport, recorder, recorder, None)       # the recorder is the state's key too
    state = hook.state(recorder)
    m = matrices[transport.rank]
    outs, calls = [], []
    for _ in range(steps):
        recorder.calls = []
        bucket = Bucket([_NAME], [m.shape], [m.reshape(-1)], Op.AVERAGE, m.dtype)
        outs.append(hook.reduce(bucket, comm, state)[0].reshape(m.shape))
        calls.append(recorder.calls)
    return calls, outs, state.get("errors", {}).get(_NAME)


def run(p: int, rows: int, cols: int, rank: int, steps: int = 1, seed: int = 0):
    """Run the hook on ``p`` thread ranks; return (matrices, hook, per-rank results of :func:`_rank_body`)."""
    rng = np.random.default_rng(seed)
    matrices = [rng.integers(-9, 10, (rows, cols)).astype(np.float64) for _ in range(p)]
    hooks = [PowerSGD(rank, start_iter=0, min_compression_rate=0, seed=seed) for _ in range(p)]
    results = run_threads(p, lambda t: _rank_body(t, matrices, hooks[t.rank], steps), timeout=30)
    return matrices, hooks[0], results


def _show(a: np.ndarray, indent: str = "    ") -> str:
    text = np.array2string(np.asarray(a), precision=3, suppress_small=True, floatmode="maxprec")
    return "\n".join(indent + line for line in text.splitlines())


def render(p: int, rows: int, cols: int, rank: int, steps: int = 1, seed: int = 0) -> str:
    """The printout of :func:`run`."""
    matrices, hook, results = run(p, rows, cols, rank, steps, seed)
    r = hook.compresses((rows, cols), hook.start_iter)
    avg = np.mean(matrices, axis=0)
    (p_in, p_out), (q_in, q_out) = results[0][0][0]            # rank 0, step 1: its two allreduces
    lines = [f"PowerSGD rank {rank} on {p} thread ranks: each holds a {rows} x {cols} matrix M_i "
             f"(seed {seed}); r = min(rank, rows, cols) = {r}", "",
             "M_i: each rank's gradient (error feedback adds last step's error: none at step 1)"]
    for i, m in enumerate(matrices):
        lines += [f"  rank {i}:", _show(m)]
    q0 = hook._initial_q(_NAME, cols, r, np.float64, 0)
    lines += ["", f"Q: {cols} x {r}, the same on every rank (drawn from the seed and the tensor's name)", _show(q0),
              "", f"P_i = M_i Q: {rows} x {r}, each rank's own"]
    for i, res in enumerate(results):
        lines += [f"  rank {i}:", _show(res[0][0][0][0].reshape(rows, r))]
    pm = p_out.reshape(rows, r)
    lines += ["", f"allreduce 1 (Average) of every P: {rows * r} elements per rank  ->  P, the same on every rank",
              _show(pm)]
    ortho = pm.copy()
    orthonormalise(ortho, EPSILON)
    lines += ["", "P orthonormalised (Gram-Schmidt, column by column): P^T P = I", _show(ortho),
              "", f"Q_i = M_i^T P: {cols} x {r}, each rank's own"]
    for i, res in enumerate(results):
        lines += [f"  rank {i}:", _show(res[0][0][1][0].reshape(r, cols).T)]     # Q travels as Q^T
    lines += ["", f"allreduce 2 (Average) of every Q: {cols * r} elements per rank  ->  Q, the same on every rank",
              _show(q_out.reshape(r, cols).T)]
    out = results[0][1][0]
    err = avg - out
    lines += ["", "approximation P Q^T (every rank, the same bits):", _show(out),
              "", "true average of the M_i:", _show(avg),
              "", "error (average - approximation):", _show(err),
              f"  |error| / |average| = {np.linalg.norm(err) / np.linalg.norm(avg):.3f}"
              f"  (Frobenius norms; rank {r} of at most {min(rows, cols)})",
              "", f"sent per rank: {(rows + cols) * r} elements in 2 allreduces, against {rows * cols} "
              f"for plain allreduce ({rows * cols / ((rows + cols) * r):.2f}x fewer)",
              "each rank keeps e_i = M_i - P Q^T and adds it to its next gradient (error feedback)"]
    if steps > 1:
        lines += ["", "|average - x| / |average| by step, x = that step's output, and x = the mean of "
                  "the outputs so far", "step  this step  mean so far"]
        total = np.zeros_like(avg)
        for t, out_t in enumerate(results[0][1], 1):
            total += out_t
            step_err = np.linalg.norm(avg - out_t) / np.linalg.norm(avg)
            mean_err = np.linalg.norm(avg - total / t) / np.linalg.norm(avg)
            lines.append(f"{t:>4}  {step_err:>9.3f}  {mean_err:>11.4f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``allreduce-explain powersgd [--ranks P] [--rows R] [--cols C] [--rank K] [--steps N] [--seed S]``."""
    parser = argparse.ArgumentParser(
        prog="allreduce-explain powersgd",
        description="Run the PowerSGD hook on thread ranks with a small integer matrix per rank and print "
                    "M, Q, P, the two allreduces, the approximation and the error.")
    parser.add_argument("--ranks", "-p", type=int, default=2, metavar="P", help="thread ranks (1..16)")
    parser.add_argument("--rows", type=int, default=4, help="rows of each matrix")
    parser.add_argument("--cols", type=int, default=3, help="columns of each matrix")
    parser.add_argument("--rank", type=int, default=1, metavar="K", help="PowerSGD's rank")
    parser.add_argument("--steps", type=int, default=1, metavar="N", help="steps to run (error feedback)")
    parser.add_argument("--seed", type=int, default=0, help="the matrices' and Q's seed")
    args = parser.parse_args(argv)
    for field, low, high in (("ranks", 1, 16), ("rows", 1, 12), ("cols", 1, 12), ("rank", 1, 12),
                             ("steps", 1, 1000)):
        if not low <= getattr(args, field) <= high:
            parser.error(f"--{field} must be in {low}..{high}, got {getattr(args, field)}")
    sys.stdout.write(render(args.ranks, args.rows, args.cols, args.rank, args.steps, args.seed))
    return 0
