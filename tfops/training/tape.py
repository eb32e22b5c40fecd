"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns averaged gradients.

::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = tfops.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # reduced over all ranks

The gradients are reduced as :mod:`tfops.training.grad_reduce` describes (one grouped
call per group; by default, inside ``tf.function``, buckets in backprop order
that start while backprop runs, :mod:`tfops.training.overlap`; sparse ones allgathered;
sources registered with :meth:`register_local_source` stay local, divided by
``size()``). :func:`PartialDistributedGradientTape` registers the trainable
variables of some Keras layers as local. For a submit per variable, as
backprop reaches it, see :mod:`tfops.training.hooks`.
"""
from __future__ import annotations

import weakref

import keras
import tensorflow as tf

from allreduce.ops import Adasum

from .grad_reduce import GradientSettings, reduce_step, source_key
from ..collectives.compression import Compression
from ..collectives.dispatch import Average, Sum, check_op

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]



REDUCED: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
"""The eager gradients a DistributedGradientTape returned, by ``id`` while they live: an optimizer
that reduces the gradients itself (``ShardedOptimizer``) refuses them."""

class DistributedGradientTape:
    """Wrap ``gradtape`` so :meth:`gradient` reduces the gradients across ranks.

    Every other attribute (``watch``, ``stop_recording``, ...) is the wrapped tape's.
    The argument order is Horovod's.

    Args:
        gradtape: a ``tf.GradientTape`` (inside or after its ``with`` block).
        device_dense, device_sparse: accepted for Horovod compatibility; unused (the engine
            reduces in host memory).
        compression: ``Compression.none`` (default), ``fp16`` or ``bf16`` for the dense gradients.
        sparse_as_dense: densify ``IndexedSlices`` gradients (embeddings) before reducing.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with ``Average``: ``1/f`` before the sum, ``f/size`` after.
        num_groups, groups: reduce in this many groups (or these lists of variables).
        process_set: reduce over this :class:`tfops.ProcessSet` only (default: all ranks); a rank
            outside the set keeps its own gradients, as in Horovod.
        scale_local_gradients: divide local sources' gradients by ``size()`` (Horovod's default).
        comm_hook: not in Horovod: a communication hook, ``tfops.PowerSGD(rank=2)`` or
            ``tfops.OneBit()``, that reduces the dense gradients (each bucket) in place of the plain
            allreduce, sending fewer bytes; not with ``compression``, Adasum or a predivide.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense: bool = False, op=Average, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups=None, process_set=None, scale_local_gradients: bool = True,
                 comm_hook=None):
        op = check_op(op)
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"DistributedGradientTape supports op=Average, Sum or Adasum, got {op!r}")
        self._tape = gradtape
        self._settings = GradientSettings(op=op, compression=compression, sparse_as_dense=bool(sparse_as_dense),
                                          gradient_predivide_factor=gradient_predivide_factor,
                                          num_groups=int(num_groups or 0), groups=groups, process_set=process_set,
                                          scale_local_gradients=bool(scale_local_gradients), comm_hook=comm_hook)
        self._settings.check("DistributedGradientTape")

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank: not reduced, divided by ``size()``."""
        self._settings.register_local(source)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """``tape.gradient(...)``, then the gradients reduced over all ranks (same structure)."""
        kwargs.pop("use_generic_names", None)        # Horovod's naming switch: names here are positions anyway
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        reduced = reduce_step(tf.nest.flatten(grads), flat_sources, self._settings, "tape")
        if tf.executing_eagerly():                   # (in a tf.function the ops themselves say so)
            for g in reduced:
                if g is not None:
                    REDUCED[id(g)] = g
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """The gradients split in two lists of ``(source, gradient)``: local sources, then the others."""
        flat = tf.nest.flatten(sources)
        grads = self.gradient(target, flat, output_gradients=output_gradients)
        local = [(s, g) for s, g in zip(flat, grads) if source_key(s) in self._settings.local]
        shared = [(s, g) for s, g in zip(flat, grads) if source_key(s) not in self._settings.local]
        return local, shared

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)


def local_layer_variables(local_layers, who: str) -> list:
    """The trainable variables of ``local_layers`` (one Keras layer, a list of them, or ``None``)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    bad = [type(layer).__name__ for layer in local_layers if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise ValueError(f"{who}: local_layers must be keras.layers.Layer objects, got {bad}")
    return [v for layer in local_layers for v in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=None, local_layers=None,
                                   scale_local_gradients=True):
    """A :class:`DistributedGradientTape` whose ``local_layers``' gradients are not reduced.

    Args:
        local_layers: a Keras layer or a list of them; their trainable variables are local sources
            (their gradients divided by ``size()``). ``None``: the plain distributed tape.
        the rest: as :class:`DistributedGradientTape`.
    """
    variables = local_layer_variables(local_layers, "PartialDistributedGradientTape")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for v in variables:
        tape.register_local_source(v)
    return tape
