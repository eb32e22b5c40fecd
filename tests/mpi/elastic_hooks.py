"""A comm hook across an elastic recovery (tests/test_engine_hooks_mpi.py).

Run under ``allreduce-run --elastic -np 3``: every step each rank allreduces an integer-valued
8 x 8 gradient (Sum) through one ``ar.PowerSGD(rank=1, start_iter=2)`` object made once per
process, and commits. Name 2 SIGKILLs itself at step 4. The survivors' recovery builds a new
engine (a new communicator of size 2), where the hook's state starts empty on both: its
reduction count restarts, so the next two steps are plain (the exact sum, checked) and the
third is low-rank again, on both survivors alike. Each step prints
``STEP <name> <step> <size> <the hook's count on this engine> <exact>``; the survivors end with
``FINAL <name>``.
"""
import os
import signal

import numpy as np

import allreduce as ar
from allreduce import api, elastic
from allreduce.elastic import world


def main() -> None:
    ar.init()
    me = world.name()
    hook = ar.PowerSGD(rank=1, start_iter=2, min_compression_rate=1)
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 8:
            s, rank, size = state.step, ar.rank(), ar.size()
            if me == 2 and s == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            g = (np.arange(64.0).reshape(8, 8) * (s + 1) + 7 * rank) % 11 - 5.0
            got = ar.allreduce(g, op=ar.Sum, name="w", comm_hook=hook)
            exact = sum((np.arange(64.0).reshape(8, 8) * (s + 1) + 7 * r) % 11 - 5.0 for r in range(size))
            count = hook.state(api._engine.comm)["steps"]["w"]
            print(f"STEP {me} {s} {size} {count} {int(np.array_equal(got, exact))}", flush=True)
            state.step = s + 1
            state.commit()

    train(state)
    print(f"FINAL {me}", flush=True)
    ar.shutdown()


if __name__ == "__main__":
    main()
