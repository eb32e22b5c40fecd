"""``keras.remat`` and ``keras.RematScope`` where layers read their weights through a ``StatelessScope``.

Keras' remat on TensorFlow is ``tf.recompute_grad``: its custom gradient returns gradients for
the function's arguments and for the *variables* it reads. Two distributed paths make layers
read tensors in place of their variables (``keras.StatelessScope``): ``GradientHooks.forward()``
(each trainable variable read once, through its allreduce hook) and ``fully_shard``'s units
(the gathered whole weights). To ``tf.recompute_grad`` such a tensor is a closure, neither
argument nor variable, so its gradient is dropped: the weight gets ``None``, its hook never
fires (``wait`` fails), and stage 3's recompute reads the released variable (``RuntimeError``)::

    forward()    w ──hook──> w_h ──┐ (captured)
    remat(f)(x)        x ──────────┴──> [ f ] ──> y      tf.recompute_grad: dx only; dw_h lost

:func:`install` (run when :mod:`tfops.training.hooks` is imported, so by ``import tfops``)
replaces the TensorFlow backend's ``remat`` (what ``keras.remat`` and ``RematScope`` layers
call) with ``tf.recompute_grad``'s recipe written out, with three differences:

- the float values of the ``StatelessScope`` active at the call go in as inputs of the custom
  gradient, and ``f`` is recomputed in backprop under a scope reading them: ``dw_h`` flows into
  each hook once, when backprop reaches it, and is reduced once; stage 3's unit gets the
  gradient of its gathered weights, reduce-scattered once (tests/mpi/recompute_check.py counts
  the elements reduced);
- keyword arguments (Keras passes ``training=`` and ``mask=`` to a ``RematScope`` layer's call)
  are closed over: ``tf.recompute_grad`` raises on them inside a ``tf.function``, so
  ``RematScope(mode="full")`` failed in ``model.fit`` and every ``tf.function`` step;
- the recompute replays the forward's random numbers and assigns nothing. Each Keras
  ``SeedGenerator`` drawn during the forward is recorded with the state it had (what ``next``
  returns), and the recompute runs in a ``StatelessScope`` mapping that state to it: a dropout
  mask in backprop is the forward's (Megatron re-runs a checkpointed forward under the forward's
  RNG state for the same reason), and the generator and BatchNorm's statistics are not advanced
  twice. ``tf.recompute_grad`` (Keras' own) drew a new mask, so dropout's gradients were wrong.

Collectives inside ``f`` run again in the recompute, as in Megatron's full checkpointing: a
``RowParallelDense`` under ``keras.remat`` allreduces its output once in the forward and once
more in backprop (every rank recomputes, so the ranks' collectives stay matched).

With no scope active the gradients are ``tf.recompute_grad``'s: the arguments' that a tape
records and the variables' ``f`` reads. Cost: the same recompute, one more forward of ``f`` in
backprop (its collectives included).
"""
from __future__ import annotations

import functools

import tensorflow as tf
from keras.src.backend.common import stateless_scope
from keras.src.random.seed_generator import SeedGenerator
from tensorflow.python.eager import record

__all__ = ["install"]


_DRAWS: list = []          # one list per remat'd forward running now: (SeedGenerator, state it had)


def install() -> None:
    """Make the TensorFlow backend's ``remat`` scope-aware and RNG-replaying (idempotent; see the
    module docstring)."""
    from keras.src.backend.tensorflow import core
    if not getattr(core.remat, "_tfops_scope_aware", False):
        core.remat = _remat
    if not getattr(SeedGenerator.next, "_tfops_recorded", False):
        SeedGenerator.next = _recorded_next(SeedGenerator.next)


def _recorded_next(next_):
    """``SeedGenerator.next`` that tells each recording forward the state it drew (its return value)."""
    @functools.wraps(next_)
    def draw(self, *args, **kwargs):
        seed = next_(self, *args, **kwargs)
        for draws in _DRAWS:
            if all(g is not self for g, _ in draws):          # the first draw: later ones follow from it
                draws.append((self, seed))
        return seed
    draw._tfops_recorded = True
    return draw


def _remat(f):
    @functools.wraps(f)
    def call(*args, **kwargs):
        return _recompute(f, args, kwargs)
    return call


_remat._tfops_scope_aware = True


def _recompute(f, args, kwargs):
    """``f(*args, **kwargs)``, its inside recomputed in backprop. The gradient flows to the tensors
    in ``args`` that a tape records, to the variables ``f`` reads, and to the float values of the active
    ``StatelessScope`` (what ``f``'s layers read in place of their variables), which go in as
    inputs and are read again, under a scope of their own, when ``f`` is recomputed. ``kwargs``
    (Keras' ``training``, ``mask``) are closed over."""
    flat = tf.nest.flatten(args)
    # only the arguments a tape records go in: a gradient nobody asks for (the model's input) would
    # still be computed in backprop, and with it a column layer's backward allreduce
    where = [i for i, a in enumerate(flat) if (tf.is_tensor(a) or isinstance(a, tf.Variable))
             and record.should_record_backprop([tf.convert_to_tensor(a)])]
    tensors = [tf.convert_to_tensor(flat[i]) for i in where]
    scope = stateless_scope.get_stateless_scope()
    mapped = dict(scope.state_mapping) if scope is not None else {}      # id(variable) -> value
    keys = [k for k, t in mapped.items() if t.dtype.is_floating]
    n = len(tensors)

    def rebuild(xs):
        items = list(flat)
        for i, x in zip(where, xs):
            items[i] = x
        return tf.nest.pack_sequence_as(args, items)

    draws = []                                          # the seed generators f draws, and their states

    @tf.custom_gradient
    def run(*xs):
        _DRAWS.append(draws)
        try:
            with record.stop_recording():                 # no tape keeps f's inside
                out = f(*rebuild(xs[:n]), **kwargs)
        finally:
            _DRAWS[:] = [d for d in _DRAWS if d is not draws]      # by identity: nested remats' lists are equal

        def grad(*dys, variables=None):                 # variables: those f read for real
            variables = list(variables or [])
            with tf.GradientTape() as tape:
                again_in = [tf.identity(x) for x in xs]
                if not tf.executing_eagerly():             # after dys, and not merged with the forward's
                    again_in = [x + tf.cast(_after(dys[0]), x.dtype) for x in again_in]   # ops (as tf.recompute_grad)
                tape.watch(again_in)
                tape.watch(variables)
                replay = {id(g.state): seed for g, seed in draws}     # the forward's random numbers
                with _scope_like(scope, {**mapped, **replay, **dict(zip(keys, again_in[n:]))}):
                    again = f(*rebuild(again_in[:n]), **kwargs)   # the activations made again
            grads = tape.gradient(again, again_in + variables,
                                  output_gradients=list(dys) if isinstance(again, (list, tuple)) else dys[0])
            return grads[:len(again_in)], grads[len(again_in):]
        return out, grad
    return run(*tensors, *[mapped[k] for k in keys])


def _scope_like(scope, mapping: dict):
    """A ``StatelessScope`` like ``scope`` (None: a plain one) reading ``mapping`` (id(variable) -> value);
    what ``f`` assigns in it is dropped: the forward pass already made those updates. Variables not
    in ``mapping`` are read for real (the tape sees the reads)."""
    again = stateless_scope.StatelessScope(collect_losses=scope is not None and scope.collect_losses,
                                           initialize_variables=scope is None or scope.initialize_variables)
    again.state_mapping = mapping
    return again


def _after(dy: tf.Tensor) -> tf.Tensor:
    """A scalar 0 that depends on ``dy`` (one element read), NaN-safe, as ``tf.recompute_grad``'s."""
    first = tf.reduce_max(tf.reshape(dy, [-1])[:1])
    same = tf.cast(first, tf.bool)
    return tf.where(tf.equal(same, same), 0.0, float("nan"))
