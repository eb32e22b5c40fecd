"""Learning-rate callbacks (``hvd.callbacks.LearningRateScheduleCallback`` and ``...WarmupCallback``).

Both set ``model.optimizer.learning_rate = initial_lr * multiplier(epoch)``:

* **Schedule**: between ``start_epoch`` and ``end_epoch`` (excluded). A
  constant ``multiplier`` means exponential decay, ``multiplier ** (epoch -
  start_epoch)``; a callable gets the epoch. ``staircase=True`` sets it once at
  each epoch's first batch with the integer epoch; ``False`` on every batch
  with the fractional epoch ``epoch + batch / steps_per_epoch``.
* **Warmup** (Goyal et al., "Accurate, Large Minibatch SGD", 2017): with p
  ranks the global batch is p times larger, so the target rate ``initial_lr``
  is usually p times the single-rank one; it is reached linearly from
  ``initial_lr / p`` over ``warmup_epochs``:
  ``multiplier(e) = (e' * (p - 1) / warmup_epochs + 1) / p`` with
  ``e' = e + 1 / steps_per_epoch`` (so each epoch ends on a round value).

Each epoch's end writes the current rate to ``logs["lr"]``, as Horovod does.
``momentum_correction`` is accepted and ignored: Keras 3 optimizers compile
their momentum into the training step as a constant, so it cannot follow the
rate batch by batch.
"""
from __future__ import annotations

import warnings

import keras
import numpy as np

import allreduce as ar

__all__ = ["LearningRateScheduleCallback", "LearningRateWarmupCallback", "warmup_multiplier"]


def _disable_xla(model) -> None:
    """Turn XLA off (with a warning): a compiled step cannot call back into Python for the allreduce."""
    if getattr(model, "jit_compile", False):
        warnings.warn("tfops: model.jit_compile was on; turning it off because XLA cannot call back into "
                      "Python for the allreduce. Pass jit_compile=False to model.compile() to silence this.",
                      stacklevel=3)
        model.jit_compile = False
        model.make_train_function(force=True)


def warmup_multiplier(epoch: float, size: int, warmup_epochs: float) -> float:
    """Goyal et al.'s gradual warmup: 1/size at epoch 0, rising linearly to 1 at ``warmup_epochs``.

    Args:
        epoch: the (fractional) epoch.
        size: ranks p; the rate starts at ``initial_lr / p``.
        warmup_epochs: epochs the ramp takes.

    Returns:
        ``(epoch * (size - 1) / warmup_epochs + 1) / size``.
    """
    return (epoch * (size - 1) / warmup_epochs + 1) / size


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """``lr = initial_lr * multiplier(epoch)`` for ``start_epoch <= epoch < end_epoch``.

    Args:
        initial_lr: the base rate (required, as in Horovod).
        multiplier: a number (exponential decay from ``start_epoch``) or ``fn(epoch) -> factor``.
        start_epoch: first epoch the schedule applies to.
        end_epoch: first epoch it no longer applies to; ``None``: to the end.
        staircase: adjust once per epoch (integer epochs) instead of every batch.
        momentum_correction: accepted for Horovod compatibility; ignored (module docstring).
        steps_per_epoch: batches per epoch, for ``staircase=False``; default: what ``fit`` reports.
    """

    def __init__(self, initial_lr, multiplier, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: int | None = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("LearningRateScheduleCallback: initial_lr is required")
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_train_begin(self, logs=None):
        _disable_xla(self.model)
        if self.staircase or self.steps_per_epoch:
            return
        self.steps_per_epoch = self.params.get("steps")
        if not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__} needs steps_per_epoch: fit() did not report it")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(epoch)
        else:
            self._set(epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (module docstring).

    Args:
        initial_lr: the rate at the end of warmup.
        warmup_epochs: epochs to ramp over.
        momentum_correction: accepted for Horovod compatibility; ignored.
        steps_per_epoch: batches per epoch; default: what ``fit`` reports.
        verbose: rank 0 prints the rate when warmup ends.
    """

    def __init__(self, initial_lr, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs}")

        def multiplier(epoch):      # each batch sets the rate its end would reach, so epochs end round
            return warmup_multiplier(epoch + 1.0 / self.steps_per_epoch, ar.size(), warmup_epochs)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and ar.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished learning-rate warmup to {self.initial_lr:g}.")
