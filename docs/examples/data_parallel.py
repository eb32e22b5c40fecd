"""Data parallelism in 40 lines: 4 ranks, each with a quarter of the batch, average their gradients.

Linear regression, loss = mean over the batch of (x.w - y)^2. Each rank computes
the gradient of the mean loss over *its* shard; the allreduce Average of the
four gradients equals the gradient over the whole batch, so every rank takes
exactly the step one big machine would take.

    python docs/examples/data_parallel.py             # equal shards: identical to the full batch
    python docs/examples/data_parallel.py --uneven    # unequal shards: see what breaks
"""
import sys

import numpy as np

from allreduce import Average, Communicator, Config
from allreduce.transport.threads import run_threads

P, BATCH, FEATURES = 4, 64, 3
rng = np.random.default_rng(0)
X, w_true = rng.standard_normal((BATCH, FEATURES)), np.array([1.0, -2.0, 0.5])
Y = X @ w_true + 0.1 * rng.standard_normal(BATCH)
w = np.zeros(FEATURES)


def grad(x, y, w):
    """Gradient of mean((x.w - y)^2) with respect to w."""
    return 2 * x.T @ (x @ w - y) / len(y)


cuts = [0, 8, 16, 40, 64] if "--uneven" in sys.argv else [0, 16, 32, 48, 64]


def rank_main(transport):
    comm = Communicator(transport, config=Config(algorithm="ring"))
    lo, hi = cuts[comm.rank], cuts[comm.rank + 1]            # my shard of the global batch
    return comm.allreduce(grad(X[lo:hi], Y[lo:hi], w), op=Average)


averaged = run_threads(P, rank_main)
full = grad(X, Y, w)
print("shard sizes:          ", np.diff(cuts).tolist())
print("full-batch gradient:  ", np.round(full, 6))
print("averaged on rank 0:   ", np.round(averaged[0], 6))
print("same on every rank:   ", all(np.array_equal(a, averaged[0]) for a in averaged))
print("equal to full batch:  ", bool(np.allclose(averaged[0], full, rtol=1e-12, atol=1e-12)))
