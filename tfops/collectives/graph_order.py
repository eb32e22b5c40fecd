"""TF1 graphs: tfops' ops run in the order the program created them, on every rank.

Every tfops op is a blocking collective. Eagerly, and inside ``tf.function``
(automatic control dependencies between stateful ops), TensorFlow runs them
in program order. A TF1 graph (``tf.compat.v1`` graph mode, ``Session.run``)
has no such order: the executor runs independent ops in any order, so with
one inter-op thread rank 0 may block in allreduce ``A`` while rank 1 blocks in
allreduce ``B``, and neither returns (Horovod's kernels are asynchronous and
do not block a thread; ours call into Python and do). Measured: Horovod's
``test_horovod_allreduce_cpu_fused`` (15 allreduces fetched by one
``Session.run``) hung in graph mode with ``TF_NUM_INTEROP_THREADS=1``.

:func:`ordered` gives each tfops op created in a TF1 graph (outside control
flow) a control dependency on the previous one. Fetching an op then also
runs the tfops ops created before it in that graph (once per ``run``, on
every rank alike): the order every rank agrees on, at the price of running
earlier collectives a fetch did not name.
"""
from __future__ import annotations

import weakref

import tensorflow as tf
from tensorflow.python.framework import func_graph

__all__ = ["ordered"]

_last: "weakref.WeakKeyDictionary[tf.Graph, tf.Operation]" = weakref.WeakKeyDictionary()


def ordered(make):
    """``make()`` (which creates one tfops op and returns its outputs), after the previous one.

    Eagerly, inside a ``tf.function`` (a ``FuncGraph``, ordered by TF itself) and inside TF1
    control flow (``tf.cond``/``while_loop`` contexts, where a dependency on an op outside
    is not allowed), ``make()`` runs unchanged.
    """
    if tf.executing_eagerly():
        return make()
    graph = tf.compat.v1.get_default_graph()
    if isinstance(graph, func_graph.FuncGraph) or graph._get_control_flow_context() is not None:
        return make()
    previous = _last.get(graph)
    with graph.control_dependencies([] if previous is None else [previous]):
        out = make()
    first = out[0] if isinstance(out, (list, tuple)) else out
    _last[graph] = first.op
    return out
