"""tfops: TensorFlow 2 / Keras 3 on the allreduce engine, with Horovod's API.

A Horovod script changes one import line::

    import horovod.tensorflow.keras as hvd   ->   import tfops.keras as hvd
    import horovod.tensorflow as hvd         ->   import tfops as hvd

and runs the same way: ``mpirun -np 4 python train.py`` (or ``allreduce-run``).

Covered names (same names and argument names as Horovod):

``tfops``
    init, shutdown, is_initialized, size, rank, local_rank, local_size,
    Sum, Average, Min, Max, Product, Compression (none, fp16, bf16; compress/decompress take
    tf tensors as well as the engine's numpy arrays: tfops.collectives.compression),
    allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none,
    op=None, prescale_factor=1.0, postscale_factor=1.0, name=None), grouped_allreduce(tensors, ...the
    same; any op; tf.IndexedSlices allgathered), allgather(tensor, name=None),
    broadcast(tensor, root_rank, name=None) (both with Horovod's averaged gradients: tfops.collectives.gather),
    broadcast_variables(variables, root_rank), broadcast_(variables, root_rank),
    broadcast_global_variables(root_rank), broadcast_object(obj, root_rank=0),
    broadcast_object_fn(root_rank=0), allgather_object(obj), start_timeline(file_path,
    mark_cycles=False), stop_timeline(), size_op(), rank_op(), local_size_op(), local_rank_op(),
    the capability queries (mpi_built ... is_homogeneous: tfops.collectives.queries), cross_size(), cross_rank(),
    MismatchError (also a tf.errors.FailedPreconditionError: tfops.errors). Dtypes: Horovod's ten (uint8 ... bool) and
    bfloat16.
    DistributedGradientTape(gradtape, compression=..., sparse_as_dense=False, op=Average),
    DistributedOptimizer(optimizer, name=None, compression=..., sparse_as_dense=False, op=Average,
    backward_passes_per_step=1, average_aggregated_gradients=False).
    Beyond Horovod: GradientHooks(model, op=Average, compression=..., sparse_as_dense=False)
    (each gradient's allreduce starts while backprop goes on: tfops.training.hooks), the
    DistributedOptimizer argument hooks=GradientHooks(model) (the same in model.fit), and
    XlaNotSupportedError.

``tfops.keras``
    the same, plus callbacks.BroadcastGlobalVariablesCallback(root_rank),
    callbacks.MetricAverageCallback(),
    callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=5, momentum_correction=True,
    steps_per_epoch=None, verbose=0).

Also: alltoall(tensor, splits=None, name=None) -> rows, or (rows, received_splits) given
splits; reducescatter(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0);
grouped_allgather(tensors); grouped_reducescatter(tensors, op=Average, ...) (tfops.collectives.scatter);
ProcessSet(ranks), add_process_set, remove_process_set, global_process_set,
process_set_included_op, init(process_sets=...), and process_set= on every collective
(tfops.collectives.process_sets).

optimizers.LARS (layer-wise adaptive rate scaling, not in Horovod: tfops.optimizers.lars).
PowerSGD, OneBit, CommHook (the engine's communication hooks, not in Horovod: ``comm_hook=`` on
DistributedOptimizer, DistributedGradientTape and GradientHooks; docs/13-sending-fewer-bytes.md).

join() (for uneven data: tfops.collectives.ops.join, allreduce.join) and op=Adasum on allreduce,
grouped_allreduce, DistributedGradientTape and DistributedOptimizer (allreduce/algorithms/adasum.py).

Not covered: tf.compat.v1 optimizers; ``momentum_correction`` (accepted, ignored). TF1 graphs run
the ops in creation order on every rank (tfops.collectives.graph_order); errors there are ``UnknownError``.

Every op works eagerly, inside ``tf.function`` and inside ``model.fit`` (a
``tf.numpy_function`` into the engine, with a registered gradient; see
:mod:`tfops.collectives.ops`). XLA (``jit_compile=True``) cannot call back into Python:
the ops raise :class:`XlaNotSupportedError` when traced there, and the
Keras callbacks turn ``model.jit_compile`` off with a warning.
"""
from __future__ import annotations

from ._autograph import leave_unconverted as _leave_unconverted

_leave_unconverted()     # AutoGraph does not rewrite tfops' functions, as it does not TF's and Keras's

import allreduce as _ar  # noqa: E402
from allreduce import CommHook, OneBit, PowerSGD   # comm_hook=: the engine's hooks, not in Horovod (issue 32)

# tfops.collectives: the collectives on tensors, and the one way down to the engine (dispatch)
from .collectives.ops import (Adasum, Average, Compression, Max, Min, Product, Sum, XlaNotSupportedError, allreduce,
                              grouped_allreduce, join)
from .collectives.gather import (allgather, allgather_object, broadcast, broadcast_, broadcast_global_variables,
                                 broadcast_object, broadcast_object_fn, broadcast_variables)
from .collectives.scatter import alltoall, grouped_allgather, grouped_reducescatter, reducescatter
from .collectives.process_sets import (NotInProcessSetError, ProcessSet, add_process_set, global_process_set,
                                       process_set_included_op, remove_process_set, with_process_set)
from .collectives import process_sets as _sets
from .collectives import queries as _queries
from .collectives.queries import (_executing_eagerly, ccl_built, cross_rank, cross_size, cuda_built,  # noqa: F401
                                  ddl_built, gloo_built, gloo_enabled, is_homogeneous, local_rank_op, local_size_op,
                                  mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank_op, rocm_built,
                                  size_op, sycl_built)   # _executing_eagerly: Horovod re-exports it; its tests call it
from .errors import MismatchError
# tfops.training: what training does with them
from .training.hooks import GradientHooks
from .training.optimizer import DistributedOptimizer
from .training.tape import DistributedGradientTape, PartialDistributedGradientTape
from .training.sync_batch_norm import SyncBatchNormalization
from .sharding import ShardedOptimizer   # not in Horovod: ZeRO stage 1 and 2 (issue 33)
from .sharding import fully_shard        # not in Horovod: ZeRO stage 3 (issue 44)
from . import elastic   # hvd.elastic: run, TensorFlowKerasState, TensorFlowState (issue 25)
from . import optimizers   # not in Horovod: LARS for large batches (Keras 3 has Lamb, not LARS; issue 34)

# process_set= on the world ops (the global set, the default, runs them unchanged)
allreduce = with_process_set(allreduce, _sets.allreduce_in_set)
grouped_allreduce = with_process_set(grouped_allreduce, _sets.grouped_allreduce_in_set)
allgather = with_process_set(allgather, _sets.allgather_in_set)
broadcast = with_process_set(broadcast, _sets.broadcast_in_set)
broadcast_object = with_process_set(broadcast_object, _sets.broadcast_object_in_set)
broadcast_object_fn = with_process_set(broadcast_object_fn, _sets.broadcast_object_fn_in_set)
allgather_object = with_process_set(allgather_object, _sets.allgather_object_in_set)

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
           "Sum", "Average", "Min", "Max", "Adasum", "Compression", "allreduce", "grouped_allreduce",
           "allgather", "broadcast", "broadcast_variables", "broadcast_object", "allgather_object", "join",
           "DistributedGradientTape", "DistributedOptimizer", "ShardedOptimizer", "fully_shard", "GradientHooks", "XlaNotSupportedError",
           "alltoall", "reducescatter", "grouped_allgather", "grouped_reducescatter",
           "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
           "process_set_included_op", "NotInProcessSetError",
           "PartialDistributedGradientTape", "SyncBatchNormalization",
           "Product", "MismatchError", "broadcast_", "broadcast_global_variables", "broadcast_object_fn",
           "start_timeline", "stop_timeline", "size_op", "rank_op", "local_size_op", "local_rank_op",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ccl_built", "rocm_built", "ddl_built", "sycl_built", "cuda_built", "is_homogeneous", "cross_size",
           "cross_rank", "optimizers", "PowerSGD", "OneBit", "CommHook"]


def init(comm=None, process_sets=None, **settings) -> None:
    """Start the engine on every rank of ``comm`` (default: MPI COMM_WORLD; a single process works too).

    Args:
        comm: an mpi4py communicator.
        process_sets: :class:`ProcessSet` objects (or rank lists) to register at once, as
            ``add_process_set`` would, in order (Horovod's ``hvd.init(process_sets=...)``).
        settings: ``allreduce.Config`` fields (``ALLREDUCE_*`` environment variables also apply).
    """
    _ar.init(comm, **settings)
    _queries.is_homogeneous()           # measured once, on every rank, while every rank is here
    global_process_set.ranks = list(range(_ar.size()))
    for process_set in process_sets or ():
        add_process_set(process_set)


def shutdown() -> None:
    """Stop the engine; collectives raise until :func:`init` is called again."""
    _ar.shutdown()


def is_initialized() -> bool:
    return _ar.is_initialized()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write the engine's Chrome-trace timeline to ``file_path`` from now on (``hvd.start_timeline``).

    Call it on every rank: rank 0 writes ``file_path``, rank r ``<stem>.rank<r><suffix>``.
    ``mark_cycles`` adds a ``CYCLE_START`` tick per engine cycle. Replaces a running timeline.
    """
    _ar.start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Finish the timeline file (``hvd.stop_timeline``); :func:`start_timeline` may start another."""
    _ar.stop_timeline()


def size() -> int:
    """The number of ranks."""
    return _ar.size()


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return _ar.rank()


def local_rank() -> int:
    """This process's rank among the ranks on its node."""
    return _ar.local_rank()


def local_size() -> int:
    """The number of ranks on this node."""
    return _ar.local_size()
