"""``horovod.tensorflow.util``'s public-by-use helper: ``_executing_eagerly()``.

Horovod scripts and tests guard TF1-only code with ``hvd._executing_eagerly()``
(Horovod re-exports it from ``horovod.tensorflow.util``); tfops offers the same
name in both places. It is ``tf.executing_eagerly()``: TF 2 always has eager
execution, so Horovod's "eager is supported" half is always true here.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """True when ops run eagerly here (False while a ``tf.function`` or a TF1 graph is built)."""
    return tf.executing_eagerly()
