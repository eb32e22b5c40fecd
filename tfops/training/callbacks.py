"""Keras callbacks for data-parallel training (``hvd.callbacks``).

* :class:`BroadcastGlobalVariablesCallback` - root's model and optimizer state on every rank, before the first step.
* :class:`MetricAverageCallback` - epoch-end metrics averaged over ranks (each rank saw its shard).
* :class:`LearningRateWarmupCallback` - Goyal et al. 2017 warmup from ``lr / size`` up to ``lr``.
* :class:`LearningRateScheduleCallback` - ``lr = initial_lr * multiplier(epoch)`` over a range of epochs
  (these two live in :mod:`tfops.training.lr_schedule`).
* :class:`BestModelCheckpoint` - ``keras.callbacks.ModelCheckpoint`` that keeps the best model, on rank 0 only.

Every one of them also turns off XLA (``model.jit_compile``) with a warning
at the start of ``fit``: XLA cannot call back into Python, and Keras 3's
``jit_compile="auto"`` turns it on on GPU machines.
"""
from __future__ import annotations

import keras
import numpy as np

import allreduce as ar

from .grad_reduce import source_key
from .lr_schedule import LearningRateScheduleCallback, LearningRateWarmupCallback, _disable_xla
from ..collectives.gather import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback", "BestModelCheckpoint"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` when training starts.

    Args:
        root_rank: the rank whose initial weights every rank starts from.
        local_variables: variables (or one variable) that keep each rank's own values: not broadcast.
        process_set: broadcast within this :class:`tfops.ProcessSet` only, from ``root_rank`` (a
            world rank in it): with a tensor-parallel mesh, ``process_set=mesh.data_set,
            root_rank=mesh.rank_of(data_rank=0)`` (each tensor rank keeps its own slices).
    """

    def __init__(self, root_rank: int = 0, local_variables=None, process_set=None):
        super().__init__()
        self.root_rank, self.process_set = root_rank, process_set
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        self.local_variables = {source_key(v) for v in local_variables}
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        _disable_xla(self.model)
        if self.broadcast_done:
            return
        variables = list(self.model.variables)
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        variables = [v for v in variables if source_key(v) not in self.local_variables]
        broadcast_variables(variables, root_rank=self.root_rank, process_set=self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each numeric entry of the epoch-end ``logs`` by its average over ranks.

    Put it before callbacks that read the logs (checkpointing, early stopping, LR schedules).
    """

    def on_train_begin(self, logs=None):
        _disable_xla(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.isreal(v))
        if not keys:
            return
        values = ar.allreduce(np.array([float(logs[k]) for k in keys], np.float64), op=ar.Average)
        for k, v in zip(keys, values):
            logs[k] = float(v)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the best model seen so far, on rank 0 only (Horovod's ``BestModelCheckpoint``).

    A ``keras.callbacks.ModelCheckpoint`` with ``save_best_only=True``; other
    ranks do nothing, so ranks never write the same file at once. Put
    :class:`MetricAverageCallback` before it so ``monitor`` is the ranks' average.

    Args:
        monitor, verbose, save_weights_only, mode, save_freq: as ``ModelCheckpoint``'s (Horovod's order).
        filepath: where to save. Horovod's has none (its Spark estimator sets ``filepath`` later);
            Keras 3 needs one when the callback is made, so the default is ``best_model.keras``
            (``best_model.weights.h5`` with ``save_weights_only``) in the working directory.
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        if filepath is None:
            filepath = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def _should_save_model(self, *args, **kwargs):
        return ar.rank() == 0 and super()._should_save_model(*args, **kwargs)

    def on_train_batch_end(self, batch, logs=None):
        if ar.rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if ar.rank() == 0:
            super().on_epoch_end(epoch, logs)


