"""``ShardedOptimizer``: the wrapper that runs a Keras optimizer on this rank's shard alone.

One step, for each dtype's flat space (:mod:`.layout`)::

    backprop ─> grads of bucket 0 ─> reduce-scatter ─┐   (buckets in backprop order; each starts
            ─> grads of bucket 1 ─> reduce-scatter ─┤    as soon as its gradients exist)
                                                     v
                         my slice of the averaged gradient (s = ceil(N/p) elements)
                                                     │ clip by the true norms (.norms), if asked
                                                     v
                   inner optimizer.apply(slice grads, slice weights)   slots: s elements each
                                                     │
                                                     v
                        allgather the slices ─> every model weight, updated, on every rank

Steps: (1) copy this rank's slice of the model's weights into the segment variables (so a
broadcast, ``load_weights`` or elastic restore of the model is always seen); (2) reduce-scatter
each bucket (Average); (3) clip; (4) the inner optimizer's ``apply`` on the segments; (5) allgather
and assign the model's variables. Every rank ends with the same bits: each element is computed by
one rank only.

Memory per rank, float32, Adam (K = 8 bytes of slots per parameter), N parameters, p ranks:

    unsharded   4N weights + 4N gradients + KN slots               = 16N
    stage 1     4N weights + 4N gradient buffer + KN/p slots        = 8N + 8N/p
    stage 2     4N weights + 4N/p gradient + one bucket + KN/p slots = 4N + 12N/p

Stage 1 reduce-scatters out of one persistent full-size flat gradient buffer (DeepSpeed's
stage 1); stage 2 lays each bucket into one reused bucket-sized buffer, keeps only its part of
the slice, and frees the bucket's gradients (in a ``tf.function`` TF drops them once the
bucket's op has run). TensorFlow's own copies come on top: see BENCHMARKS.md "Sharding".
Stage 3 (sharded weights, gathered layer by layer) is not here; docs/14-sharding.md.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import allreduce as ar
from keras.src.utils import tracking

from .exchange import allgather_slice, check_same_model, reducescatter_bucket
from .lamb import SegmentLamb
from .layout import shards
from .norms import clip_segments

__all__ = ["ShardedOptimizer", "ShardedOptimizerWrapper"]

_CANNOT = {"Adafactor": "its second moment is factored into row and column statistics of each whole "
                        "matrix, which no 1-D slice holds",
           "Muon": "it orthogonalises each whole weight matrix (Newton-Schulz), which no 1-D slice holds",
           "LossScaleOptimizer": "it skips a step when any gradient is not finite, a decision each shard "
                                 "would make alone; wrap the ShardedOptimizer's inner optimizer instead",
           "MultiOptimizer": "it routes whole variables to optimizers; shard each optimizer instead"}


def _check_inner(opt) -> None:
    if not isinstance(opt, keras.optimizers.Optimizer):
        raise TypeError(f"ShardedOptimizer wraps a keras.optimizers.Optimizer (Keras 3), got {type(opt).__name__}")
    for cls in type(opt).__mro__:
        if cls.__name__ in _CANNOT:
            raise TypeError(f"ShardedOptimizer cannot shard {type(opt).__name__} exactly: {_CANNOT[cls.__name__]}. "
                            "Use tfops.DistributedOptimizer for it.")
        if cls.__name__ == "DistributedOptimizerWrapper":
            raise TypeError("ShardedOptimizer reduces the gradients itself: wrap the plain Keras optimizer, "
                            "not a DistributedOptimizer")
    if opt.use_ema or opt.gradient_accumulation_steps:
        raise ValueError("ShardedOptimizer: use_ema and gradient_accumulation_steps of the inner optimizer are "
                         "not supported (they keep per-variable state outside the shards)")


def _from_tape(g) -> bool:
    """A gradient a tfops reduction produced (DistributedGradientTape inside a tf.function)."""
    op = getattr(g, "op", None)
    while op is not None and op.type == "Identity":
        op = op.inputs[0].op
    return op is not None and op.name.rsplit("/", 1)[-1].startswith(("tfops_grad_wait", "tfops_allreduce",
                                                                       "tfops_grouped"))


@keras.saving.register_keras_serializable(package="tfops", name="ShardedOptimizer")
class ShardedOptimizerWrapper(keras.optimizers.Optimizer):
    """The wrapper :func:`ShardedOptimizer` returns; ``inner_optimizer`` updates this rank's segments."""

    def __init__(self, inner_optimizer, *, stage: int = 2, name=None, bucket_bytes: int | None = None,
                 clipnorm_of_model=None, global_clipnorm_of_model=None, **_ignored):
        _check_inner(inner_optimizer)
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer stage must be 1 (optimizer states) or 2 (and gradients), got "
                             f"{stage!r}; stage 3 (weights) is not implemented")
        super().__init__(learning_rate=0.0, name=name or f"Sharded{inner_optimizer.name}")
        self.stage = int(stage)
        self.bucket_bytes = bucket_bytes
        # the true norms are taken here, across shards (.norms): the inner optimizer must not clip a shard
        self.shard_clipnorm = clipnorm_of_model if clipnorm_of_model is not None else inner_optimizer.clipnorm
        self.shard_global_clipnorm = (global_clipnorm_of_model if global_clipnorm_of_model is not None
                                      else inner_optimizer.global_clipnorm)
        inner_optimizer.clipnorm = inner_optimizer.global_clipnorm = None
        if type(inner_optimizer) is keras.optimizers.Lamb:
            inner_optimizer = SegmentLamb.from_config(inner_optimizer.get_config())
        self.inner_optimizer = inner_optimizer

    # -- layout, once --------------------------------------------------------------------
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        var_list = list(var_list)
        check_same_model(var_list, "ShardedOptimizer")
        rank, size = ar.rank(), ar.size()
        self._model_vars = var_list
        self._shards = shards(var_list, rank, size, self.bucket_bytes)
        for sh in self._shards:                           # a rank with no element would skip the step
            if (size - 1) * sh.per_rank >= sh.total:
                raise ValueError(f"ShardedOptimizer: {sh.total} {sh.dtype} elements are too few to shard over "
                                 f"{size} ranks (rank {size - 1} would own none)")
        segs = sorted((s for sh in self._shards for s in sh.segments), key=lambda s: (s.var, s.var_start))
        self._segments = segs
        self._seg_vars = []
        for s in segs:
            model_var = var_list[s.var]
            with keras.name_scope(f"shard{s.var}", caller=self):
                self._seg_vars.append(keras.Variable(tf.zeros([s.size], model_var.dtype), dtype=model_var.dtype,
                                                     name=model_var.name.split("/")[-1].split(":")[0]))
        self._load_slices()
        inner = self.inner_optimizer
        if isinstance(inner, SegmentLamb):
            inner.owners, inner.n_vars = tuple(s.var for s in segs), len(var_list)
        excluded = getattr(inner, "_exclude_from_weight_decay", None)      # AdamW's var_list exclusions
        if excluded:
            inner._exclude_from_weight_decay = set(excluded) | {
                inner._var_key(sv) for s, sv in zip(segs, self._seg_vars) if inner._var_key(var_list[s.var]) in excluded}
            inner._exclude_from_weight_decay_cache = {}
        inner.build(self._seg_vars)
        self._buffers = {}
        for sh in self._shards:                           # setup here; the step allocates none of these
            longest = max(b.stop - b.start for b in sh.buckets)
            self._buffers[sh.dtype] = np.zeros(sh.padded if self.stage == 1 else longest, sh.dtype)
        super().build(var_list)

    def _build_once(self, variables) -> None:
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(list(variables))

    # -- the step --------------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars, **kwargs):
        """Apply ``(gradient, variable)`` pairs of *local* gradients (see :func:`ShardedOptimizer`)."""
        grads, variables = zip(*list(grads_and_vars))
        self.apply(list(grads), list(variables))
        return self.iterations

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Reduce-scatter the local ``grads``, step the inner optimizer on this rank's slice, allgather."""
        if trainable_variables is None and not self.built:
            raise ValueError("build the optimizer first, or pass trainable_variables")
        variables = list(trainable_variables) if trainable_variables is not None else self._model_vars
        self._build_once(variables)
        grads = list(grads)
        if len(grads) != len(self._model_vars) or any(v is not w for v, w in zip(variables, self._model_vars)):
            raise ValueError(f"ShardedOptimizer was built for {len(self._model_vars)} variables and is applied to "
                             f"{len(variables)} others; apply it to the same variables, in the same order, every step")
        missing = [v.name for g, v in zip(grads, variables) if g is None]
        if missing:
            raise ValueError(f"ShardedOptimizer needs a gradient for every variable it shards; none for {missing[:5]}. "
                             "Leave variables that get no gradient out of the trainable ones")
        if any(_from_tape(g) for g in grads):
            raise ValueError("ShardedOptimizer got gradients already reduced by DistributedGradientTape; it "
                             "reduce-scatters them itself: use a plain tf.GradientTape")
        seg_grads = self._reduce_scatter(grads)
        seg_grads = clip_segments(seg_grads, [s.var for s in self._segments], len(self._model_vars),
                                  clipnorm=self.shard_clipnorm, global_clipnorm=self.shard_global_clipnorm)
        self._load_slices()
        self.inner_optimizer.apply(seg_grads, self._seg_vars)
        self._gather_into_model()

    def _load_slices(self) -> None:
        for s, sv in zip(self._segments, self._seg_vars):
            sv.assign(tf.reshape(self._model_vars[s.var], [-1])[s.var_start:s.var_start + s.size])

    def _reduce_scatter(self, grads) -> list:
        out: dict[int, tf.Tensor] = {}
        for sh in self._shards:
            buf, parts = self._buffers[sh.dtype], []
            for bk in sh.buckets:                         # backprop order: the last variables' bucket first
                def run(*arrays, sh=sh, bk=bk, buf=buf):
                    at = bk.start if self.stage == 1 else 0
                    return reducescatter_bucket(list(arrays), sh, bk, buf[at:at + bk.stop - bk.start])
                xs = [tf.cast(tf.convert_to_tensor(grads[v]), sh.dtype) for v in bk.vars]
                part = tf.numpy_function(run, xs, tf.as_dtype(sh.dtype), stateful=True, name="tfops_shard_rs")
                part.set_shape([bk.counts[ar.rank()]])
                parts.append((max(bk.start, sh.lo), part))
            mine = tf.concat([p for _, p in sorted(parts, key=lambda t: t[0])], 0)
            for s in sh.segments:
                out[s.var] = mine[s.slice_start:s.slice_start + s.size]
        return [out[s.var] for s in self._segments]

    def _gather_into_model(self) -> None:
        for sh in self._shards:
            mine = [sv for s, sv in zip(self._segments, self._seg_vars) if s.var in sh.vars]
            pad = sh.per_rank - sum(s.size for s in sh.segments)
            flat_mine = tf.concat([tf.convert_to_tensor(v) for v in mine] + [tf.zeros([pad], sh.dtype)], 0)
            full = tf.numpy_function(lambda a, sh=sh: allgather_slice(a, sh), [flat_mine], tf.as_dtype(sh.dtype),
                                     stateful=True, name="tfops_shard_ag")
            for v, at, n in zip(sh.vars, sh.offsets, sh.sizes):
                self._model_vars[v].assign(tf.reshape(full[at:at + n], self._model_vars[v].shape))

    # -- what belongs to the inner optimizer ---------------------------------------------
    @property
    def variables(self):
        return self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        pass                                              # no EMA (refused in __init__)

    def get_config(self):
        return {"name": self.name, "stage": self.stage, "bucket_bytes": self.bucket_bytes,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "clipnorm_of_model": self.shard_clipnorm, "global_clipnorm_of_model": self.shard_global_clipnorm}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def ShardedOptimizer(optimizer, stage: int = 2, *, name: str | None = None, bucket_bytes: int | None = None):
    """Wrap a Keras 3 optimizer so each rank keeps and updates only its 1/p shard (ZeRO stage 1 or 2).

    Use it where :func:`tfops.DistributedOptimizer` goes: ``model.compile(optimizer=...,
    jit_compile=False)``, or ``apply_gradients`` / ``apply`` in a custom loop (eager or in a
    ``tf.function``). It takes each rank's *local* gradients and exchanges them itself
    (reduce-scatter, then allgather of the updated weights: the bytes of one allreduce), so never
    combine it with :class:`tfops.DistributedGradientTape`; where the tape's reduction can be seen
    (inside a ``tf.function``) that raises ``ValueError``.

    Args:
        optimizer: a Keras 3 optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop,
            Adagrad, Adamax, Nadam, Lion, Adadelta, Ftrl) or Lamb (its per-variable norms are
            reduced across shards). ``clipnorm`` and ``global_clipnorm`` clip by the true norms.
            Adafactor and Muon raise ``TypeError``: they need whole matrices.
        stage: 1 shards the optimizer's slots; 2 (default) also keeps only this rank's slice
            of the averaged gradient.
        name: the wrapper's name; default ``"Sharded" + optimizer.name``.
        bucket_bytes: gradient bytes per reduce-scatter call (default
            :data:`tfops.overlap.BUCKET_BYTES`); every rank must pass the same value.

    Returns:
        A ``keras.optimizers.Optimizer``. Every rank must build it over the same variables, in
        the same order (else ``MismatchError`` on every rank before the first step), and every
        variable needs a gradient each step.
    """
    return ShardedOptimizerWrapper(optimizer, stage=stage, name=name, bucket_bytes=bucket_bytes)
