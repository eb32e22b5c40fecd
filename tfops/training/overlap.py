"""A step's gradients reduced while backprop still runs: buckets in backprop order, waited for once.

Inside a ``tf.function`` (and ``model.fit``) the tape and the optimizer do not wait for the
whole backward pass before the first byte moves::

    backprop:   dense2 grads ── dense1 grads ── conv3 ── conv2 ── conv1 grads
                      │                                              │
    submit ops:   bucket 0 ─────────────────────────────────────  bucket 1      (engine, async)
    wire:             [──── bucket 0 on the link ────][── bucket 1 ──]
    wait op:                                                          └─ all results ─> apply

1. the gradients, last variable first (backprop produces the output layer's first), are cut
   into buckets of about :data:`BUCKET_BYTES` (a bucket closes once it holds that many);
2. each bucket is one ``numpy_function`` that depends on its gradients only: TF runs it as
   soon as they exist, and it hands them to the engine (``grouped_allreduce_async``: packed
   once into the engine's own array, one tensor per bucket) and returns at once;
3. one ``numpy_function`` that depends on every bucket's token waits for the handles and
   returns the reduced gradients, in order;
4. inside a ``tf.function``, the ops that only later buckets need wait (a control dependency)
   for the earlier bucket's submit (:func:`_submit_first`). Without it TF's executor, which runs
   one ready kernel inline and queues the others (last in, first out on its thread), computed
   each weight gradient at the end of backprop: with one inter-op thread every submit came
   within 0.4 ms of the last, after the whole backward pass (the engine's timeline, 2 ranks).

Horovod gets the same overlap from an asynchronous TF op per gradient; here a bucket is one
Python call instead of one per gradient (ResNet-50 has 161 gradients). Eagerly ``tape.gradient``
returns every gradient at once, so there is nothing to overlap: one grouped call does it
(:func:`tfops.collectives.ops.grouped_dense`).

With a ``comm_hook`` (PowerSGD, OneBit) the buckets and their submits are the same; the
engine runs the hook on what each of its cycles finds ready, so the hook's collectives overlap
backprop as the plain allreduce does.

Cost: one submit call per bucket (~30-50 us) and one wait; the packing copy the grouped call
made anyway. Every rank cuts the same buckets: the cut depends on static shapes and dtypes only.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph

import allreduce as ar

from ..collectives.dispatch import numpy_call

__all__ = ["BUCKET_BYTES", "buckets", "reduce_overlapped"]

BUCKET_BYTES = 1 << 20
"""A bucket closes once it holds this many bytes. Smaller: communication starts earlier and a
step pays more submit calls; the engine still fuses buckets that are ready together."""


def buckets(xs: list, bucket_bytes: int | None = None) -> list[list[int]]:
    """Positions of ``xs`` in backprop order (last first), cut after each ``bucket_bytes``
    (default :data:`BUCKET_BYTES`). A tensor of unknown size counts 0 bytes."""
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    out: list[list[int]] = []
    held = bucket_bytes
    for i in reversed(range(len(xs))):
        if held >= bucket_bytes:
            out.append([])
            held = 0
        out[-1].append(i)
        held += (xs[i].shape.num_elements() or 0) * xs[i].dtype.size
    return out


def reduce_overlapped(xs: list, names: list[str], op, compression, comm_hook=None) -> list:
    """The graph-mode reduction of dense gradients ``xs`` (named by position, ``names``), each
    bucket submitted as soon as its gradients exist (module docstring). A ``comm_hook``
    (``ar.PowerSGD``, ``ar.OneBit``) reduces each bucket in place of the plain allreduce."""
    handles: dict[int, object] = {}        # bucket -> its GroupedHandle, between submit and wait
    order = buckets(xs)
    tokens = []
    for k, members in enumerate(order):
        def submit(*arrays, k=k, members=members):
            handles[k] = ar.grouped_allreduce_async(list(arrays), name=f"{names[members[0]]}+group", op=op,
                                                    compression=compression, comm_hook=comm_hook)
            return np.int32(k)
        tokens += numpy_call("grad_submit", submit, [xs[i] for i in members], [tf.int32])

    def collect(*_tokens):
        out: list = [None] * len(xs)
        for k, members in enumerate(order):
            for i, y in zip(members, handles.pop(k).wait()):
                out[i] = y
        return out
    ys = numpy_call("grad_wait", collect, tokens, [x.dtype for x in xs])
    for x, y in zip(xs, ys):
        y.set_shape(x.shape)
    if len(order) > 1 and isinstance(tf.compat.v1.get_default_graph(), func_graph.FuncGraph):
        _submit_first([[xs[i] for i in members] for members in order], [t.op for t in tokens])
    return ys


def _submit_first(groups: list[list[tf.Tensor]], submits: list[tf.Operation]) -> None:
    """Make each op that bucket ``k`` needs and no earlier bucket does, where it reads a result of
    an earlier bucket's ops, wait for bucket ``k-1``'s submit: backprop then hands a bucket to the
    engine before it computes what only later buckets need.

    Steps: label each ancestor op of the gradients with the first bucket that needs it (one walk,
    bucket by bucket, each op visited once); a labelled op with an input labelled lower is where
    its bucket's part of backprop starts. No cycle: ``submits[k]`` depends on ops labelled <= k
    only. Left as it is (no edge added) where a later bucket's ops include a stateful op with no
    resource input: TF chains those in program order with the submits, before which it was made.
    An op that ``submits[k-1]`` already waits for (:func:`_ancestors`, the edges added for earlier
    buckets included) gets no edge: it would close a cycle, as an embedding gradient's allgather
    made before the submits once did (TF: "678 nodes in a cycle" on examples/gpt.py at hidden 128)."""
    graph = submits[0].graph
    label: dict[tf.Operation, int] = {}
    for k, tensors in enumerate(groups):
        stack = [t.op for t in tensors if t.op.graph is graph]
        while stack:
            op = stack.pop()
            if op in label:
                continue
            label[op] = k
            stack += [i.op for i in op.inputs if i.op.graph is graph and i.op not in label]
            stack += [c for c in op.control_inputs if c.graph is graph and c not in label]
    starts: list[list[tf.Operation]] = [[] for _ in groups]
    for op, k in label.items():
        if k == 0:
            continue
        if op._is_stateful and not any(i.dtype == tf.resource for i in op.inputs):   # noqa: SLF001
            return
        if any(label.get(i.op, k) < k for i in op.inputs) or any(label.get(c, k) < k for c in op.control_inputs):
            starts[k].append(op)
    for k in range(1, len(groups)):
        before = _ancestors(submits[k - 1])
        for op in starts[k]:
            if op not in before:
                op._add_control_input(submits[k - 1])     # noqa: SLF001 - as TF's automatic control deps do


def _ancestors(op: tf.Operation) -> set:
    """Every op of ``op``'s graph that ``op`` waits for: through inputs and control inputs, and
    (as TF's automatic control dependencies will chain them when the function is finished) every
    stateful op with no resource input made before it, with what those wait for."""
    graph, stack = op.graph, [op]
    for other in graph.get_operations():              # creation order
        if other is op:
            break
        if other._is_stateful and not any(i.dtype == tf.resource for i in other.inputs):   # noqa: SLF001
            stack.append(other)
    seen: set = set(stack[1:])
    while stack:
        cur = stack.pop()
        for parent in [i.op for i in cur.inputs] + list(cur.control_inputs):
            if parent.graph is graph and parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen
