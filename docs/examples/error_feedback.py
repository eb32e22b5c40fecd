"""fp16 compression loses small gradients; error feedback gets them back.

Two thread ranks train nothing: for 100 steps each submits the same tiny
gradient, 1e-8 per element, averaged with fp16 on the wire. 1e-8 is below
fp16's smallest subnormal (6e-8), so every step rounds it to zero and the
"update" never moves. With error feedback the rounding error of each step
is kept per tensor and added to the next one: the residual grows until it
is representable, is sent, and the sum over the steps comes out right.

    python docs/examples/error_feedback.py
    python docs/examples/error_feedback.py bf16     # the same run with Compression.bf16 (lesson 6's exercise)
"""
import sys

import numpy as np

from allreduce import Average, Config
from allreduce.engine.compression import Compression
from allreduce.engine.engine import Engine
from allreduce.transport.threads import ThreadWorld

STEPS, GRAD = 100, 1e-8


def total_update(compression) -> float:
    world = ThreadWorld(2)
    engines = [Engine(world.transport(r), config=Config(cycle_time=0.2)) for r in range(2)]
    total = 0.0
    for _ in range(STEPS):
        handles = [e.submit(np.full(4, GRAD, np.float32), name="grad", op=Average, compression=compression)
                   for e in engines]
        results = [h.wait() for h in handles]
        total += float(results[0][0])
    for e in engines:
        e.shutdown()
    return total


CHOICES = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16,
           "fp16 + error feedback": Compression.fp16.with_error_feedback()}
chosen = ["none", *sys.argv[1:]] if sys.argv[1:] else ["none", "fp16", "fp16 + error feedback"]
print(f"exact sum of {STEPS} averaged gradients: {STEPS * GRAD:.3e}")
for label, compression in [(name, CHOICES[name]) for name in chosen]:
    print(f"{label:>22}: {total_update(compression):.3e}")
