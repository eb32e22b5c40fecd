"""What every optimizer wrapper of tfops hands to the optimizer it wraps.

``DistributedOptimizer``, ``ShardedOptimizer`` (stages 1 and 2) and the stage-3
``FullyShardedOptimizer`` are Keras optimizers that own no update rule: Keras
and the user read and set the learning rate, the step counter and the loss
scale on the wrapper, and each must land on ``inner_optimizer``, which does the
update. One base class says that once.
"""
from __future__ import annotations

import keras

__all__ = ["WrappingOptimizer"]


class WrappingOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer whose ``learning_rate``, ``iterations`` and ``scale_loss`` are its
    ``inner_optimizer``'s (set ``self.inner_optimizer`` in ``__init__``), rebuilt from a config that
    holds ``inner_optimizer`` serialized beside the wrapper's keyword arguments."""

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The wrapper again from ``get_config()``: the inner optimizer's own config, then the settings."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **cls._settings_from_config(config))

    @staticmethod
    def _settings_from_config(config: dict) -> dict:
        """The keyword arguments of ``__init__`` from a config (a wrapper whose settings JSON changes converts them)."""
        return config
