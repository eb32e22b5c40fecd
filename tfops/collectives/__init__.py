"""Horovod's collectives on TensorFlow tensors, and what they stand on.

=================  =====================================================================================
file               holds
=================  =====================================================================================
ops.py             allreduce, grouped_allreduce, join (and each gradient)
gather.py          allgather, broadcast, broadcast_variables, the object helpers
scatter.py         alltoall, reducescatter, grouped_reducescatter, grouped_allgather
process_sets.py    ProcessSet and ``process_set=`` on every collective
dispatch.py        the one way down to the engine: numpy_call, submit/wait, the dense allreduce + gradient
eager.py           the eager fast path (numpy views of tensors, no numpy_function)
graph_order.py     TF1 graphs: the ops in creation order on every rank
arguments.py       op/average and prescale/postscale, Horovod's rules
compression.py     Compression.none/fp16/bf16 on tensors and arrays; the comm_hook check
queries.py         capability queries (mpi_built ...), cross_rank, the ``*_op`` tensors
=================  =====================================================================================

Imports run one way: tfops.training -> tfops.collectives -> the engine (``allreduce``);
nothing here imports tfops.training. The public names are ``tfops``'s (``tfops.allreduce``, ...).
"""
