"""Gradient hooks: start each gradient's allreduce the moment backprop produces it.

::

    hooks = tfops.GradientHooks(model)
    with tf.GradientTape() as tape:
        with hooks.forward():                 # reads of trainable variables go through a hook
            loss = loss_fn(model(x), y)
    grads = tape.gradient(loss, model.trainable_variables)
    grads = hooks.wait(grads)                 # reduced; then optimizer.apply(grads)

and in ``model.fit``, the optimizer waits for the handles::

    opt = tfops.DistributedOptimizer(keras.optimizers.SGD(0.1), hooks=tfops.GradientHooks(model))
    model.compile(optimizer=opt, ...); model.fit(...)

Inside ``forward()`` every trainable variable is read through an identity
op with a ``tf.custom_gradient``. Its gradient function runs when backprop
reaches the variable (the output layer first) and submits that gradient to
the engine (``allreduce_async``) before backprop moves on to the layers
below, so communication overlaps the rest of backprop, as PyTorch DDP's
bucket hooks do. ``wait`` blocks on the handles. The forward pass sees the
variables through ``keras.StatelessScope``; updates the forward makes to
other variables (batch-norm statistics, dropout seeds) are written back when
``forward()`` exits. Recompute (``keras.remat``, ``keras.RematScope``) inside ``forward()``
recomputes under the same hooked reads (:mod:`.remat`): each hook still fires once.

The engine's timeline shows the overlap: with ``ALLREDUCE_TIMELINE`` set,
``examples/synthetic_benchmark.py --mode hooks`` reports how many allreduces
started before backprop submitted its last gradient (8 of 10 on 2 ranks of a
2-core VM; 0 of 10 with ``--mode tape``).

Sparse gradients (embeddings) are allgathered in ``wait`` unless
``sparse_as_dense=True``. Each hooked variable must be used by one
``forward()`` per ``wait``. On a single rank the hooks stand aside: the
forward pass is unhooked and ``wait`` returns the gradients as they are.
"""
from __future__ import annotations

import contextlib
import functools

import allreduce as ar
import keras
import numpy as np
import tensorflow as tf

from . import remat
from .grad_reduce import gradient_names
from ..collectives.compression import Compression, check_comm_hook, check_compression
from ..collectives.dispatch import Average, Sum, check_op, numpy_call, submit, wait
from ..collectives.ops import allreduce

__all__ = ["GradientHooks"]

remat.install()       # keras.remat / RematScope: recompute reading forward()'s hooked tensors, and in a tf.function


class GradientHooks:
    """Allreduce hooks on a Keras model's trainable variables.

    Args:
        model: a Keras model (or layer); its ``trainable_variables`` are hooked.
        op: ``Average`` (default) or ``Sum``.
        compression: ``Compression.none`` (default), ``fp16`` or ``bf16``.
        sparse_as_dense: densify ``IndexedSlices`` gradients and overlap them too.
        comm_hook: a communication hook (``tfops.PowerSGD(...)``, ``tfops.OneBit()``) that reduces
            each gradient, as backprop produces it, in place of the plain allreduce: here every
            gradient is a bucket of its own. Not with ``compression``.
    """

    def __init__(self, model, op=Average, compression=Compression.none, sparse_as_dense: bool = False,
                 comm_hook=None):
        self.model = model
        self.op = check_op(op)
        if self.op not in (Average, Sum):
            raise ValueError(f"GradientHooks supports op=Average or Sum, got {self.op!r}")
        self.compression = check_compression(compression)
        self.comm_hook = check_comm_hook(comm_hook, "GradientHooks")
        if self.comm_hook is not None and self.compression is not Compression.none:
            raise ValueError(f"GradientHooks: pass comm_hook= or compression=, not both (got {self.comm_hook!r} "
                             f"and {self.compression!r})")
        self.sparse_as_dense = sparse_as_dense
        self._handles: dict[str, object] = {}

    @contextlib.contextmanager
    def forward(self):
        """Context for the forward pass: trainable variables are read through the hooks.

        On one rank there is nothing to reduce, and the forward pass runs unhooked: reducing over
        one rank is the identity, so single-process training runs at full speed (the tape and the
        optimizer skip the engine there too, as Horovod does)."""
        if ar.size() == 1:
            yield
            return
        variables = list(self.model.trainable_variables)
        names = gradient_names("hooks", len(variables))
        mapping = [(v, self._hook(tf.convert_to_tensor(v), n)) for v, n in zip(variables, names)]
        hooked = {id(v) for v in variables}
        with keras.StatelessScope(state_mapping=mapping) as scope:
            yield
        # The scope held every assignment made in the forward pass; apply them for real.
        for v in self.model.variables:
            if id(v) not in hooked:
                value = scope.get_current_value(v)
                if value is not None:
                    v.assign(value)

    def install(self) -> "GradientHooks":
        """Run every forward pass of the model inside :meth:`forward` (for ``model.fit``). Idempotent.

        Sets ``model.call`` on the instance to a wrapper around the class's ``call``.
        """
        if not getattr(self.model, "_tfops_hooks_installed", False):
            call = self.model.call

            @functools.wraps(call)
            def hooked_call(*args, **kwargs):
                with self.forward():
                    return call(*args, **kwargs)
            self.model.call = hooked_call
            self.model._tfops_hooks_installed = True
        return self

    def _hook(self, x: tf.Tensor, name: str) -> tf.Tensor:
        handles, op, compression, comm_hook = self._handles, self.op, self.compression, self.comm_hook

        def start(g):
            # A copy: the engine reads the array later, from its own thread, and TF owns g's memory.
            handles[name] = submit(np.array(g), name, op, compression, comm_hook)
            return g

        @tf.custom_gradient
        def identity(x):
            def grad(dy):
                if isinstance(dy, tf.IndexedSlices):
                    if not self.sparse_as_dense:
                        return dy          # allgathered in wait()
                    dy = tf.convert_to_tensor(dy)
                out = numpy_call("hook_submit", start, [dy], [dy.dtype])[0]
                out.set_shape(dy.shape)
                return out
            return tf.identity(x), grad
        return identity(x)

    def wait(self, grads) -> list:
        """The reduced gradients: waits for each handle the hooks started; ``None`` stays ``None``.

        Args:
            grads: ``tape.gradient(loss, model.trainable_variables)``, unchanged.
        """
        grads = list(grads)
        names = gradient_names("hooks", len(self.model.trainable_variables))
        if len(grads) != len(names):
            raise ValueError(f"wait() needs one gradient per trainable variable ({len(names)}), got {len(grads)}")
        if ar.size() == 1:
            return grads                       # forward() ran unhooked: the gradients are the result
        out = list(grads)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                out[i] = allreduce(g, op=self.op, name=names[i])
        if dense:
            handles = self._handles

            def collect(*local):
                # The local gradients are inputs only so this runs after every hook has submitted.
                missing = [names[i] for i in dense if names[i] not in handles]
                if missing:
                    raise RuntimeError(f"no hook submitted {missing[:3]}: compute the loss inside "
                                       "hooks.forward() and pass tape.gradient's result to wait()")
                return [wait(handles.pop(names[i])) for i in dense]
            xs = [grads[i] for i in dense]
            ys = numpy_call("hook_wait", collect, xs, [x.dtype for x in xs])
            for i, x, y in zip(dense, xs, ys):
                y.set_shape(x.shape)
                out[i] = y
        return out
