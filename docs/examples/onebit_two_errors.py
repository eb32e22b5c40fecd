"""1-bit compression with two errors: the real ``ar.OneBit`` hook on 2 thread ranks (lesson 13).

::

    python docs/examples/onebit_two_errors.py            # 2 ranks, 8 values each, the same every step

Each rank sends its gradient as signs plus one scale per chunk (rank j owns chunk j); the owner
averages what it received and sends it back as signs and a scale again. So there are two
compressions, and each keeps its own error: the worker error (per rank: what its signs missed)
and the server error (per owner: what the second compression missed). Both are added back next
step. The script prints step 1 in full, then how far the mean of the outputs so far is from the
true average: with both errors fed back it goes to zero; without them every step would send the
same signs and the mean would stay at step 1's error.
"""
from __future__ import annotations

import numpy as np

from allreduce.engine.hooks import Bucket, HookComm
from allreduce.engine.onebit import OneBit
from allreduce.ops import Op
from allreduce.transport.threads import run_threads

GRADS = [np.array([0.9, -0.1, 0.3, 0.05, -0.6, 0.2, -0.02, 0.4]),
         np.array([0.5, 0.3, -0.1, 0.05, -0.2, 0.4, 0.06, -0.8])]
STEPS = (1, 10, 100, 1000)


def body(transport):
    """One rank: STEPS[-1] reductions of its constant gradient; its outputs and step 1's errors."""
    hook = OneBit()
    comm = HookComm(transport, None, None, None)          # OneBit uses alltoallv and allgatherv only
    state, outs, first = {}, [], None                     # the engine keeps this per communicator
    for step in range(1, STEPS[-1] + 1):
        g = GRADS[transport.rank]
        outs.append(hook.reduce(Bucket(["g"], [g.shape], [g], Op.AVERAGE, g.dtype), comm, state)[0])
        if step == 1:
            first = (state["worker"]["g"].copy(), state["server"]["g"].copy())
    return outs, first


def main() -> None:
    results = run_threads(2, body, timeout=60)
    average = (GRADS[0] + GRADS[1]) / 2
    np.set_printoptions(precision=3, suppress=True)
    print("true average  ", average)
    print("step 1 output ", results[0][0][0], "(one scale per chunk of 4, times the signs)")
    for r, (_, (worker, server)) in enumerate(results):
        print(f"rank {r}: worker error {worker}  server error (its chunk) {server}")
    mean = np.cumsum(results[0][0], axis=0) / np.arange(1, STEPS[-1] + 1)[:, None]
    for t in STEPS:
        gap = np.linalg.norm(mean[t - 1] - average) / np.linalg.norm(average)
        print(f"steps {t:>4}: |mean of outputs - average| / |average| = {gap:.4f}")


if __name__ == "__main__":
    main()
