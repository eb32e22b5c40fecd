"""Keras callbacks for data-parallel training (``hvd.callbacks``).

* :class:`BroadcastGlobalVariablesCallback` - root's model and optimizer state on every rank, before the first step.
* :class:`MetricAverageCallback` - epoch-end metrics averaged over ranks (each rank saw its shard).
* :class:`LearningRateWarmupCallback` - Goyal et al. 2017 warmup from ``lr / size`` up to ``lr``.

Every one of them also turns off XLA (``model.jit_compile``) with a warning
at the start of ``fit``: XLA cannot call back into Python, and Keras 3's
``jit_compile="auto"`` turns it on on GPU machines.
"""
from __future__ import annotations

import warnings

import keras
import numpy as np

import allreduce as ar

from .ops import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback"]


def _disable_xla(model) -> None:
    if getattr(model, "jit_compile", False):
        warnings.warn("tfops: model.jit_compile was on; turning it off because XLA cannot call back into "
                      "Python for the allreduce. Pass jit_compile=False to model.compile() to silence this.",
                      stacklevel=3)
        model.jit_compile = False
        model.make_train_function(force=True)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` when training starts.

    Args:
        root_rank: the rank whose initial weights every rank starts from.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        _disable_xla(self.model)
        if self.broadcast_done:
            return
        variables = list(self.model.variables)
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        broadcast_variables(variables, root_rank=self.root_rank)
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


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    Goyal et al., "Accurate, Large Minibatch SGD" (2017): with p ranks the global
    batch is p times larger, so the target rate is ``initial_lr`` (usually the
    single-rank rate times p), reached linearly, per batch:
    ``lr(e) = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`` for the
    fractional epoch ``e``.

    Args:
        initial_lr: the learning rate at the end of warmup.
        warmup_epochs: epochs to ramp over.
        momentum_correction: accepted for Horovod compatibility and ignored: Keras 3
            optimizers compile their momentum into the step, so it cannot change per batch.
        steps_per_epoch: batches per epoch; default: what ``fit`` reports.
        verbose: print the learning rate at the end of warmup.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        super().__init__()
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def multiplier(self, epoch: float) -> float:
        """The factor on ``initial_lr`` at fractional epoch ``epoch``."""
        size = ar.size()
        return min(1.0, 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1))

    def on_train_begin(self, logs=None):
        _disable_xla(self.model)
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
        if not self.steps_per_epoch:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch: fit() did not report it")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch >= self.warmup_epochs:
            return
        epoch = self.current_epoch + batch / self.steps_per_epoch
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and ar.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished learning-rate warmup to {self.initial_lr:g}.")
