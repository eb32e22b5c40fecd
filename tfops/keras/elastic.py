"""Elastic ``model.fit``: Horovod's ``hvd.elastic`` names for Keras (``import tfops.keras as hvd``).

::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(data, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

* :class:`CommitStateCallback` commits every ``batches_per_commit`` batches and at
  the end of every epoch: a death loses at most that many batches. A commit
  copies the weights and optimizer variables to host memory (see
  docs/11-when-a-rank-dies.md for how to choose the number).
* :class:`UpdateBatchStateCallback` keeps ``state.batch``: the batches of the
  current epoch already done (0 at an epoch's end).
* :class:`UpdateEpochStateCallback` keeps ``state.epoch``: the epochs done,
  counted across restarts (Keras counts from 0 at every ``fit``).

Keras 3 reads ``steps_per_epoch`` once per ``fit``, so the batches left in an
interrupted epoch are the script's to skip (``state.batch``), as with Horovod.
"""
from __future__ import annotations

import keras

from ..elastic import ObjectState, State, TensorFlowKerasState, run

__all__ = ["run", "State", "ObjectState", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer and keyword attributes (Horovod's ``KerasState``)."""


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at every epoch's end."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"batches_per_commit must be a positive integer, got {batches_per_commit!r}")
        self.state, self.batches_per_commit = state, int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit    # every rank counts from the same sync

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` = batches of the current epoch done (0 once the epoch ends)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1

    def on_epoch_begin(self, epoch, logs=None):
        self._offset = self.state.batch          # a resumed epoch counts on from its last commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0

    _offset = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` = epochs done, across restarts (Keras counts from 0 in every ``fit``)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
