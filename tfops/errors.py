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

A bad argument that only the collective finds (alltoall ``splits`` that do
not add up to the rows, rows that ``size()`` does not divide) raises
:class:`InvalidArgumentError`, both the core's and TensorFlow's, as
Horovod's ``tf.errors.InvalidArgumentError``; inside ``tf.function`` TF's
own mapping gives ``InvalidArgumentError`` too (it is a ``ValueError``).

Unsupported requests (Min/Max/Product on ``tf.IndexedSlices``, scaling of
sparse tensors) raise ``NotImplementedError``, as Horovod's do.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from allreduce import errors as _core

__all__ = ["MismatchError", "InvalidArgumentError", "tf_typed"]


class MismatchError(_core.MismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagree about a collective: ``allreduce.MismatchError`` and
    ``tf.errors.FailedPreconditionError`` at once, with the engine's message."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


class InvalidArgumentError(_core.InvalidArgumentError, tf.errors.InvalidArgumentError):
    """A bad argument found inside a collective (alltoall splits that do not add up, a length
    that ``size()`` does not divide): ``allreduce.InvalidArgumentError`` (a ``ValueError``) and
    ``tf.errors.InvalidArgumentError``, as Horovod raises, with the core's message."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)


def tf_typed(fn):
    """``fn`` with the engine's ``MismatchError`` and ``InvalidArgumentError`` re-raised as
    :class:`MismatchError` and :class:`InvalidArgumentError` (same text).

    Wraps the Python function of every tfops ``numpy_function``; the original is the
    new error's ``__cause__``.
    """
    @functools.wraps(fn)
    def call(*args):
        try:
            return fn(*args)
        except (MismatchError, tf.errors.OpError):
            raise
        except _core.MismatchError as exc:
            raise MismatchError(str(exc)) from exc
        except _core.InvalidArgumentError as exc:
            raise InvalidArgumentError(str(exc)) from exc
    return call
