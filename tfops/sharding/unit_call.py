"""A fully sharded layer's call: gather its weights, compute, let them go; in backward gather them
again, recompute, and reduce-scatter the weights' gradients straight into this rank's pieces.

One unit (a layer ``fully_shard`` wrapped), one ``tf.custom_gradient``::

    forward   pieces ─G─> whole weights ─> layer.call (in a StatelessScope) ─> outputs ─> release
                          (only inside the custom gradient: the tape records the pieces, never
                           the whole weights, so nothing outside keeps them alive)
    backward  dy ─> pieces ─G─> whole weights ─> layer.call again under a tape ─> dx, dW
                                            dW ─RS─> this rank's pieces of the averaged dW
              dx goes down only after the RS is handed over (so every rank queues the same order)

The layer runs as Keras' ``stateless_call`` runs it: a ``keras.StatelessScope`` maps each of its
variables to a value, here the gathered whole weights and a snapshot of its non-trainable state
(a seed generator's, BatchNorm's statistics). Backward recomputes with the same snapshot, so a
dropout mask is the forward's; the forward's updates of that state are assigned after the call.
Cost: the layer's forward runs twice (as under activation recompute); its activations inside
the unit live only in the recompute. Each gather op knows the cut it was traced for
(``state.generation``): after an elastic re-cut, a ``tf.function`` traced before raises rather
than gather old pieces with the new layout.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from ..collectives.dispatch import listed
from ..errors import tf_typed

__all__ = ["sharded_call"]


def _read(variables) -> list:
    """This rank's pieces (or state) as tensors: reads the tape watches."""
    return [tf.convert_to_tensor(v.value) for v in variables]


def _next(state, unit, phase: str):
    """The unit to prefetch after ``unit`` in ``phase``, and its pieces (read here: a custom
    gradient's forward may read no variable), or (None, [])."""
    after = state.after(unit, phase) if state.exchange.prefetch else None
    return (after, _read(after.shard_vars)) if after is not None else (None, [])


def _gather(state, unit, shards, phase: str, *, deps, after, after_shards) -> list[tf.Tensor]:
    """The unit's whole weights (an op), after ``deps``; hands over ``after``'s prefetch."""
    after_shards = list(after_shards)
    n = len(unit.shard_vars)
    generation = state.generation                            # the cut this op was made for

    def fn(*arrays):
        if state.generation != generation:                   # a trace older than an elastic re-cut
            raise RuntimeError(f"rank {state.comm.rank}: fully sharded model '{state.name}' was re-cut for "
                               f"{state.comm.size} ranks after this tf.function was traced: make a new "
                               "tf.function in a reset callback (state.register_reset_callbacks); model.fit "
                               "traces anew by itself")
        first = phase == "forward" and unit.index == (state.order or (0,))[0]   # the step's first gather
        if first:
            state.exchange.drop_pending()                    # a new step: no stale prefetch survives
        # traced before the call order was known, ``after`` may not run next: hand over no prefetch
        # (every rank learnt the same order; a prefetch of a unit that already ran is skipped too)
        ahead = after if after_shards and state.after(unit, phase) is after else None
        return state.exchange.gather(unit, arrays[:n], phase, after=ahead, after_shards=arrays[n:], first=first)
    with tf.control_dependencies([d for d in deps if d is not None]):
        outs = listed(tf.numpy_function(tf_typed(fn), list(shards) + after_shards,
                                        [tf.as_dtype(v.dtype) for v in unit.full_vars], stateful=True,
                                        name="tfops_fs_gather"))
    for o, v in zip(outs, unit.full_vars):
        o.set_shape(v.shape)
    return outs


def _compute(unit, original, structure, flat, where, xs, fulls, nts):
    """The layer's own ``call`` with ``fulls`` as its weights and ``nts`` as its state."""
    flat = list(flat)
    for i, x in zip(where, xs):
        flat[i] = x
    args, kwargs = tf.nest.pack_sequence_as(structure, flat)
    mapping = list(zip(unit.full_vars, fulls)) + list(zip(unit.nt_vars, nts))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        outs = original(*args, **kwargs)
    return outs, [scope.get_current_value(v) for v in unit.nt_vars]


def _differentiable(x) -> bool:
    return x.dtype.is_floating or x.dtype.is_complex


def sharded_call(state, unit, original):
    """``unit.layer.call`` for a fully sharded layer; ``original`` is the layer's own ``call``."""
    def call(*args, **kwargs):
        structure = (args, kwargs)
        flat = tf.nest.flatten(structure)
        if any(isinstance(a, keras.KerasTensor) for a in flat):          # shape inference: no data moves
            zeros = [(v, tf.zeros(v.shape, v.dtype)) for v in unit.full_vars]
            with keras.StatelessScope(state_mapping=zeros):
                return original(*args, **kwargs)
        state.check_current()                            # an elastic reset re-cuts first (.elastic_stage3)
        state.called(unit)                               # learn the call order the prefetch follows
        where = [i for i, a in enumerate(flat) if tf.is_tensor(a)]
        xs = [flat[i] for i in where]
        shards, nts = _read(unit.shard_vars), _read(unit.nt_vars)
        after, after_shards = _next(state, unit, "forward")
        nx, ns, nn, out_structure = len(xs), len(shards), len(nts), []

        @tf.custom_gradient
        def run(*inputs):
            xs_, sh_, nt_ = inputs[:nx], inputs[nx:nx + ns], inputs[nx + ns:nx + ns + nn]
            fulls = _gather(state, unit, sh_, "forward", deps=xs_, after=after, after_shards=inputs[nx + ns + nn:])
            outs, new_nt = _compute(unit, original, structure, flat, where, xs_, fulls, nt_)
            out_structure.append(outs)
            flat_out = [tf.convert_to_tensor(o) for o in tf.nest.flatten(outs)]
            with tf.control_dependencies(flat_out + list(new_nt)):
                done = tf.numpy_function(lambda: np.int32(state.exchange.release(unit, "forward") or 0), [], tf.int32,
                                         stateful=True, name="tfops_fs_release")
            with tf.control_dependencies([done]):
                flat_out = [tf.identity(o) for o in flat_out]

            def grad(*dys):
                dy = list(dys[:len(flat_out)])
                b_after, b_shards = _next(state, unit, "backward")
                fulls_b = _gather(state, unit, sh_, "backward", deps=dy, after=b_after, after_shards=b_shards)
                diff = [x for x in xs_ if _differentiable(x)]
                with tf.GradientTape() as tape:
                    tape.watch(diff + fulls_b)
                    outs_b, _ = _compute(unit, original, structure, flat, where, xs_, fulls_b, nt_)
                    fo = tf.nest.flatten(outs_b)
                dy = [tf.zeros_like(o) if d is None else d for o, d in zip(fo, dy)]
                grads = tape.gradient(fo, diff + fulls_b, output_gradients=dy)
                dxs, dws = grads[:len(diff)], grads[len(diff):]
                dws = [tf.zeros_like(w) if g is None else tf.convert_to_tensor(g) for w, g in zip(fulls_b, dws)]
                token = tf.numpy_function(tf_typed(lambda *a: np.int32(state.exchange.submit_reduce_scatter(unit, a) or 0)),
                                          dws, tf.int32, stateful=True, name="tfops_fs_rs")
                parts = listed(tf.numpy_function(tf_typed(lambda _t: state.exchange.wait_reduce_scatter(unit)), [token],
                                                 [tf.as_dtype(v.dtype) for v in unit.shard_vars], stateful=True,
                                                 name="tfops_fs_rs_wait"))
                for p, s in zip(parts, sh_):
                    p.set_shape(s.shape)
                with tf.control_dependencies([token]):          # dx leaves after the RS is queued
                    it = iter([None if g is None else tf.identity(g) for g in dxs])
                    dx_all = [next(it) if _differentiable(x) else None for x in xs_]
                return dx_all + parts + [None] * (nn + len(after_shards))
            return flat_out + list(new_nt), grad

        results = run(*xs, *shards, *nts, *after_shards)
        results = listed(results)
        n_out = len(results) - len(nts)
        for v, value in zip(unit.nt_vars, results[n_out:]):
            v.assign(value)
        return tf.nest.pack_sequence_as(out_structure[-1], results[:n_out])
    return call
