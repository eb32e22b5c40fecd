"""``hvd.callbacks`` for ``import tfops.keras as hvd``; the classes live in :mod:`tfops.training.callbacks`."""
from ..training.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                         LearningRateWarmupCallback, MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback", "BestModelCheckpoint"]
