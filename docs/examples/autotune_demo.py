"""What algorithm="auto" tried and kept at run time, per message size (docs/03-tree-and-cost.md).

    allreduce-run -np 2 python docs/examples/autotune_demo.py

Each size is reduced until the tuner has decided (every rank prints the same table; rank 0 does).
"""
import numpy as np

import allreduce as ar

ar.init(check=False)
comm = ar.communicator()
rows = []
for nbytes in (8, 4096, 65536, 1 << 20, 16 << 20):
    x = np.ones(nbytes // 4, np.float32)
    calls = 0
    while nbytes not in comm.auto_picks:
        ar.allreduce_(x, op=ar.Sum)
        calls += 1
    ar.allreduce_(x, op=ar.Sum)                      # from now on: the winner
    times = comm.tuner.decided.get(nbytes, {})
    tried = "  ".join(f"{name} {seconds * 1e6:.1f}" for name, seconds in times.items()) or "(one contender)"
    rows.append(f"{nbytes:>9}  {comm.choose(nbytes):>6}  {calls:>5}  {comm.auto_picks[nbytes]:>6}   {tried}")
if ar.rank() == 0:
    print(f"{ar.size()} ranks; the model's pick, the calls spent timing, what was kept, "
          "and each contender's best block (mean us, slowest rank)")
    print(f"{'bytes':>9}  {'model':>6}  {'calls':>5}  {'kept':>6}   tried")
    print("\n".join(rows))
ar.shutdown()
