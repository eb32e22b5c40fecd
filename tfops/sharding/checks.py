"""What ShardedOptimizer refuses, and why: optimizers that need whole tensors, wrappers that
would decide per shard, and gradients a DistributedGradientTape already reduced."""
from __future__ import annotations

import keras

__all__ = ["check_inner", "from_tape"]

_CANNOT = {"LARS": "its per-layer trust ratio needs each whole variable's norms (Lamb's are reduced across "
                   "shards; LARS's are not yet)",
           "Adafactor": "its second moment is factored into row and column statistics of each whole "
                        "matrix, which no 1-D slice holds",
           "Muon": "it orthogonalises each whole weight matrix (Newton-Schulz), which no 1-D slice holds",
           "LossScaleOptimizer": "it skips a step when any gradient is not finite, a decision each shard "
                                 "would make alone; wrap the ShardedOptimizer's inner optimizer instead",
           "MultiOptimizer": "it routes whole variables to optimizers; shard each optimizer instead"}


def check_inner(opt) -> None:
    if not isinstance(opt, keras.optimizers.Optimizer):
        raise TypeError(f"ShardedOptimizer wraps a keras.optimizers.Optimizer (Keras 3), got {type(opt).__name__}")
    for cls in type(opt).__mro__:
        if cls.__name__ in _CANNOT:
            raise TypeError(f"ShardedOptimizer cannot shard {type(opt).__name__} exactly: {_CANNOT[cls.__name__]}. "
                            "Use tfops.DistributedOptimizer for it.")
        if cls.__name__ == "DistributedOptimizerWrapper":
            raise TypeError("ShardedOptimizer reduces the gradients itself: wrap the plain Keras optimizer, "
                            "not a DistributedOptimizer")
    if opt.use_ema or opt.gradient_accumulation_steps:
        raise ValueError("ShardedOptimizer: use_ema and gradient_accumulation_steps of the inner optimizer are "
                         "not supported (they keep per-variable state outside the shards)")


def from_tape(g) -> bool:
    """A gradient a tfops reduction produced: DistributedGradientTape's, eager (it keeps them by
    ``id``, :data:`tfops.tape.REDUCED`) or inside a tf.function (the op that made it)."""
    from ..training.tape import REDUCED
    if REDUCED.get(id(g)) is g:
        return True
    op = getattr(g, "op", None)
    while op is not None and op.type == "Identity":
        op = op.inputs[0].op
    return op is not None and op.name.rsplit("/", 1)[-1].startswith(("tfops_grad_wait", "tfops_allreduce",
                                                                       "tfops_grouped"))
