"""Sharding what every rank holds: ZeRO stage 1 and 2 for Keras 3 (``tfops.ShardedOptimizer``).

Data parallelism keeps a full copy of the weights, the gradients and the optimizer's slots on
every rank: 16 bytes per parameter with Adam in float32. An allreduce is a reduce-scatter
followed by an allgather (the ring's two halves, docs/02-ring.md); ZeRO (Rajbhandari et al.,
SC'20) runs the optimizer step between the two halves, on the 1/p slice each rank just reduced::

    allreduce:   grads --reduce-scatter--> my 1/p summed --allgather--> all grads summed --> step (full)
    sharded:     grads --reduce-scatter--> my 1/p summed --> step (my 1/p) --allgather--> all weights

The bytes on the wire are the same, 2 (p-1)/p n per rank; what each rank keeps shrinks:

    ============  ==================================================  ========
    stage         per rank (Adam, float32, N parameters)              at p = 4
    ============  ==================================================  ========
    unsharded     4N weights + 4N gradients + 8N slots                 16N
    1 (states)    4N + 4N gradients + 4N/p slice + 8N/p slots          11N
    2 (+ grads)   4N + 4N/p gradient + 4N/p slice + 8N/p (+ a bucket)  8N
    ============  ==================================================  ========

(the slice: the inner optimizer's own copy of this rank's weights.)

Modules: :mod:`.layout` (flat balanced shards, segments, buckets: pure functions),
:mod:`.exchange` (the collectives and the model check), :mod:`.norms` (true norms across
shards for clipping), :mod:`.lamb` (Lamb's trust ratio over shards), :mod:`.optimizer` (the
Keras wrapper), :mod:`.state` (the whole optimizer state, gathered, for checkpoints).
"""
from .optimizer import ShardedOptimizer, ShardedOptimizerWrapper

__all__ = ["ShardedOptimizer", "ShardedOptimizerWrapper"]
from .fully_shard import fully_shard, gathered_weights   # ZeRO stage 3 (issue 44): fully_shard, .stage3
from .stage3 import FullyShardedOptimizer

__all__ += ["fully_shard", "gathered_weights", "FullyShardedOptimizer"]
