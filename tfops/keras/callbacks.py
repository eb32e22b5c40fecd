"""``hvd.callbacks`` for ``import tfops.keras as hvd``; the classes live in :mod:`tfops.callbacks`."""
from ..callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                         LearningRateWarmupCallback, MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback", "BestModelCheckpoint"]
