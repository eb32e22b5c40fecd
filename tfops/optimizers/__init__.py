"""Optimizers for large batches that Keras 3 lacks: :class:`LARS` (Keras has ``keras.optimizers.Lamb``).

::

    opt = tfops.DistributedOptimizer(tfops.optimizers.LARS(learning_rate=2.0, momentum=0.9, weight_decay=1e-4))
"""
from __future__ import annotations

from .lars import LARS

__all__ = ["LARS"]
