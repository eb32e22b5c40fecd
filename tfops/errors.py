"""The errors tfops raises, typed the way Horovod's TensorFlow ops raise them.

When ranks disagree on a collective (shape, dtype, count, root, name), the
engine raises :class:`allreduce.errors.MismatchError` on every rank. Horovod
raises ``tf.errors.FailedPreconditionError`` there, and scripts catch that.
Through tfops the error is :class:`MismatchError` below: a subclass of both,
with the engine's message (every rank's value), so either ``except`` clause
catches it.

Where it surfaces:

* eagerly, the tfops call raises it itself: ``tf.numpy_function`` run
  eagerly lets the Python exception through unchanged;
* inside ``tf.function`` (and ``model.fit``), TensorFlow turns any Python
  exception from a ``numpy_function`` into an ``OpError`` by its Python type
  only (ValueError/TypeError -> ``InvalidArgumentError``, NotImplementedError
  -> ``UnimplementedError``, anything else -> ``UnknownError``; TF 2.21's
  ``py_func.cc``). So there the caller gets ``tf.errors.UnknownError``, an
  ``OpError``, whose message starts with ``MismatchError:`` and repeats
  ours. No Python exception type can make a ``numpy_function`` fail with
  code FAILED_PRECONDITION.

Unsupported requests (Min/Max/Product on ``tf.IndexedSlices``, scaling of
sparse tensors) raise ``NotImplementedError``, as Horovod's do.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from allreduce import errors as _core

__all__ = ["MismatchError", "tf_typed"]


class MismatchError(_core.MismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagree about a collective: ``allreduce.MismatchError`` and
    ``tf.errors.FailedPreconditionError`` at once, with the engine's message."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


def tf_typed(fn):
    """``fn`` with the engine's ``MismatchError`` re-raised as :class:`MismatchError` (same text).

    Wraps the Python function of every tfops ``numpy_function``; the original is the
    new error's ``__cause__``.
    """
    @functools.wraps(fn)
    def call(*args):
        try:
            return fn(*args)
        except MismatchError:
            raise
        except _core.MismatchError as exc:
            raise MismatchError(str(exc)) from exc
    return call
