"""``import tfops.keras as hvd``: the names of ``horovod.tensorflow.keras``.

::

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)

Every name of :mod:`tfops` is here too (collectives, process sets, ...); what
differs from ``tfops`` is the argument order of :func:`DistributedOptimizer`
(Horovod's Keras order), and the Keras-only names :func:`PartialDistributedOptimizer`,
:func:`load_model` and :mod:`callbacks`.
"""
from __future__ import annotations

import keras

from .. import *  # noqa: F401,F403  (every tfops name, as horovod.tensorflow.keras re-exports horovod.tensorflow's)
from .. import __all__ as _tfops_all
from ..collectives.compression import Compression
from ..collectives.dispatch import Average
from ..training.optimizer import DistributedOptimizer as _tf_distributed_optimizer
from ..training.optimizer import DistributedOptimizerWrapper
from ..training.sync_batch_norm import SyncBatchNormalization
from ..training.tape import local_layer_variables
from . import callbacks
from . import elastic   # hvd.elastic: KerasState and the three callbacks (issue 25)

__all__ = sorted(set(_tfops_all) | {"DistributedOptimizer", "PartialDistributedOptimizer", "load_model",
                                    "SyncBatchNormalization", "callbacks", "elastic"})


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=None, scale_local_gradients=True, hooks=None, comm_hook=None):
    """``horovod.tensorflow.keras.DistributedOptimizer``: :func:`tfops.DistributedOptimizer` in Keras' order."""
    return _tf_distributed_optimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op, gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients, hooks=hooks, comm_hook=comm_hook)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=None, local_layers=None, scale_local_gradients=True):
    """A :func:`DistributedOptimizer` whose ``local_layers``' gradients are not reduced.

    Args:
        local_layers: a Keras layer or a list of them: their trainable variables are registered
            with ``register_local_var`` (gradient kept on this rank, divided by ``size()``).
        the rest: as :func:`DistributedOptimizer`.
    """
    variables = local_layer_variables(local_layers, "PartialDistributedOptimizer")
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    reducer = opt.inner_optimizer if isinstance(opt, keras.optimizers.LossScaleOptimizer) else opt
    for v in variables:
        reducer.register_local_var(v)
    return opt


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """``keras.models.load_model(filepath)`` with its optimizer wrapped in :func:`DistributedOptimizer`.

    The optimizer's saved state (slots, iterations) is kept: the loaded optimizer becomes the
    wrapper's inner optimizer. A model saved with a ``DistributedOptimizer`` loads as one.

    Args:
        filepath: a ``.keras`` file (Keras 3's format).
        custom_optimizers: optimizer classes the file uses that Keras does not know.
        custom_objects: other custom classes or functions, as for ``keras.models.load_model``.
        compression: the wrapper's gradient compression.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    reducer = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    if isinstance(optimizer, keras.optimizers.Optimizer) and not isinstance(reducer, DistributedOptimizerWrapper):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
    return model
