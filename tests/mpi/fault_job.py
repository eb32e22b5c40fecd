"""Rank script for tests/test_faults.py: break one rank in a chosen way.

    python fault_job.py raise     rank 1 raises ValueError in "user code" at step 3
    python fault_job.py exit      rank 1 calls os._exit(3) in the middle of an allreduce
    python fault_job.py kill      rank 1 SIGKILLs itself in the middle of an allreduce
    python fault_job.py silent    rank 1 stops calling collectives (sleeps)
    python fault_job.py loop TAG  every rank loops allreduce forever (signal tests)
"""
import os
import signal
import sys
import threading
import time

import numpy as np

import allreduce as ar

mode = sys.argv[1]
ar.init()
me = ar.rank()
x = np.ones(4 << 20, np.float32)          # 16 MiB: each allreduce takes a while

if mode in ("exit", "kill") and me == 1:
    def die():
        if mode == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(1.0, die).start()      # fires while the loop below is inside an allreduce

if mode == "loop":
    print(f"rank {me} ready", flush=True)
    while True:
        ar.allreduce(x, algorithm="ring")

for step in range(10_000):
    if me == 1 and step == 3:
        if mode == "raise":
            raise ValueError("boom in user code")
        if mode == "silent":
            time.sleep(600)
    ar.allreduce(x, algorithm="ring")
print(f"rank {me} UNREACHABLE: finished without noticing the fault", flush=True)
