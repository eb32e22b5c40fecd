"""Rank script: a communication hook's state is reset by an elastic recovery (tests/test_elastic_hooks.py).

::

    allreduce-run --elastic -np 3 python tests/mpi/elastic_hook.py

Every step each rank reduces its own gradient (64 x 16 float32, drawn from the step and the
rank) with ONE ``PowerSGD(rank=1, start_iter=0)`` object (error feedback and warm start on)
under the name ``w``; a commit every 2 steps; the last rank SIGKILLs itself at step ``KILL``,
before its submit. The survivors recover (restore the commit, shrink, ``ar.init()`` again:
a new communicator) and go on from the commit. Checks, each by reducing the same gradient
once more with a NEW hook of the same settings (which has no state):

* at step 3, before the death, the two results differ: the hook's state (errors, warm-start
  Q, step counts) is in use, so the check below can fail;
* at the first step after the recovery they are bitwise equal: the old hook met a new
  communicator and started there from empty state (allreduce/engine/hooks.py, "State").

Each survivor prints ``HOOK <rank> before-differs reset-ok`` at the end.
"""
from __future__ import annotations

import os
import signal

import numpy as np

import allreduce as ar
from allreduce import elastic

STEPS, KILL, EVERY = 8, 5, 2


def settings() -> ar.PowerSGD:
    return ar.PowerSGD(rank=1, start_iter=0)


def grad(step: int, rank: int) -> np.ndarray:
    return np.random.default_rng([step, rank]).standard_normal((64, 16)).astype(np.float32)


def main() -> None:
    ar.init()
    victim = ar.size() - 1
    hook, seen = settings(), {}
    state = elastic.ObjectState(step=0)
    recovered = []
    state.register_reset_callbacks([lambda: recovered.append(ar.size())])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            s = state.step
            if s == KILL and ar.rank() == victim and not recovered:
                os.kill(os.getpid(), signal.SIGKILL)
            g = grad(s, ar.rank())
            out = ar.allreduce(g, name="w", comm_hook=hook)
            first_after = recovered and "after" not in seen
            if s == 3 or first_after:
                fresh = ar.allreduce(g, name="w", comm_hook=settings())
                seen["after" if first_after else "before"] = np.array_equal(out, fresh)
            state.step = s + 1
            if state.step % EVERY == 0:
                state.commit()

    train(state)
    assert recovered == [ar.size()] and ar.size() == 2, f"expected one recovery to 2 ranks, got {recovered}"
    assert seen.get("before") is False, f"step 3: the hook's result equals a new hook's: no state in use? {seen}"
    assert seen.get("after") is True, f"after the recovery the hook still used its old state: {seen}"
    print(f"HOOK {ar.rank()} before-differs reset-ok", flush=True)
    ar.shutdown()


if __name__ == "__main__":
    main()
