"""What training does with the collectives: the tape, the optimizer, the hooks and the callbacks.

====================  =================================================================================
file                  holds
====================  =================================================================================
tape.py               DistributedGradientTape, PartialDistributedGradientTape
optimizer.py          DistributedOptimizer (Keras 3), backward_passes_per_step
aggregation.py        local gradient aggregation (backward_passes_per_step's accumulators)
grad_reduce.py        one step's gradients: local sources, predivide, groups -> reduce_gradients
gradients.py          reduce_gradients: one grouped call (eager) or overlap's buckets (graph)
overlap.py            buckets submitted while backprop runs, waited for once
hooks.py              GradientHooks: each gradient's allreduce starts during backprop
sync_batch_norm.py    SyncBatchNormalization
lr_schedule.py        warmup and schedule multipliers; callbacks.py the Keras callbacks
====================  =================================================================================

A gradient's way down: tape/optimizer -> grad_reduce.reduce_step -> gradients.reduce_gradients ->
(overlap.reduce_overlapped | collectives.ops.grouped_dense) -> collectives.dispatch -> the engine.
Imports run one way: training -> collectives -> engine.
"""
