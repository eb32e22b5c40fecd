"""``import tfops.keras as hvd``: the names of ``horovod.tensorflow.keras``.

::

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)
"""
from .. import (Average, Compression, DistributedOptimizer, GradientHooks, Max, Min, Sum,
                XlaNotSupportedError, allgather, allgather_object, allreduce, broadcast, broadcast_object,
                broadcast_variables, grouped_allreduce, init, is_initialized, local_rank, local_size, rank,
                shutdown, size)
from . import callbacks
from . import elastic   # hvd.elastic: KerasState and the three callbacks (issue 25)

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
           "Sum", "Average", "Min", "Max", "Compression", "allreduce", "grouped_allreduce", "allgather",
           "broadcast", "broadcast_variables", "broadcast_object", "allgather_object",
           "DistributedOptimizer", "GradientHooks", "XlaNotSupportedError", "callbacks"]
