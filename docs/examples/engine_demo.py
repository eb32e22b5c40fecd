"""The engine on 2 thread ranks: named tensors submitted in different orders, negotiated, fused.

    python docs/examples/engine_demo.py /tmp/timeline.json
    python docs/examples/engine_demo.py /tmp/timeline.json --no-fusion

Rank 0 submits w1, w2, b; rank 1 submits b, w2, w1. A plain collective would
deadlock or mix the tensors up; the engine matches them by name. The
timeline (Chrome trace, open it in https://ui.perfetto.dev) records what
happened to each tensor; this script prints the phases of one of them.
"""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from allreduce import Config, Sum
from allreduce.engine.engine import Engine
from allreduce.transport.threads import ThreadWorld

args = [a for a in sys.argv[1:] if not a.startswith("--")]
path = args[0] if args else str(Path(tempfile.mkdtemp()) / "timeline.json")
fusion = 0 if "--no-fusion" in sys.argv else 64 << 20
world = ThreadWorld(2)
engines = [Engine(world.transport(r), config=Config(cycle_time=5.0, timeline=path, fusion_threshold=fusion)) for r in range(2)]
orders = [["w1", "w2", "b"], ["b", "w2", "w1"]]
sizes = {"w1": 1000, "w2": 300, "b": 10}
handles = [{name: e.submit(np.full(sizes[name], r + 1.0), name=name, op=Sum) for name in orders[r]}
           for r, e in enumerate(engines)]
for name in orders[0]:
    results = [h[name].wait() for h in handles]
    print(f"{name:>2}: {sizes[name]:4d} elements, every element {results[0][0]:g} on both ranks:",
          all(np.array_equal(x, np.full(sizes[name], 3.0)) for x in results))
for e in engines:
    e.shutdown()
events = [json.loads(line.rstrip(",\n")) for line in open(path) if line.startswith("{")]
tid = next(e["tid"] for e in events if e.get("name") == "thread_name" and e["args"]["name"] == "w1")
phases = list(dict.fromkeys(e["name"] for e in events if e.get("tid") == tid and e.get("ph") in ("B", "X", "i")))
print("timeline of w1 on rank 0:", " > ".join(phases))
starts = {e["ts"] for e in events if e.get("name") == "ALLREDUCE"}
print("allreduces on rank 0:", len(starts))
