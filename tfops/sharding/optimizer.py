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
              allgather, bucket by bucket ─> every model weight, updated, on every rank

Steps: (1) copy this rank's slice of the model's weights into the segment variables (so a
broadcast, ``load_weights`` or elastic restore of the model is always seen); (2) reduce-scatter
each bucket (Average); (3) clip; (4) the inner optimizer's ``apply`` on the segments; (5) allgather
each bucket's updated parts and assign the model's variables (a variable of a bucket of
its own emptied first, so its old and new values never coexist: :mod:`.gather`). Every rank
ends with the same bits: each element is computed by one rank only.

Memory per rank, float32, Adam (K = 8 bytes of slots per parameter), N parameters, p ranks; the
inner optimizer's own copy of this rank's slice of the weights is the 4N/p term:

    unsharded   4N weights + 4N gradients + KN slots                          = 16N
    stage 1     4N weights + 4N gradients + 4N/p slice + KN/p slots           = 8N + 12N/p
    stage 2     4N weights + 4N/p gradient + 4N/p slice + KN/p (+ one bucket) = 4N + 16N/p

Both stages read a large variable's gradient where TF left it (the ring's ``keep_input``) and
pack small ones into reused buffers of at most a bucket; each ring runs a bucket's pieces a
block (``bucket_bytes``) at a time, so its scratch is a block. Nothing kept between steps is
larger than a bucket beyond what the formula counts (issue 44: a persistent full-size gradient
copy and ring slots of half the model at p = 2 were). Stage 1's 4N of gradients is TF's own,
every gradient waiting for its ring; stage 2 keeps only its part of the slice and lets each
bucket's gradients go once its ring is done; at most :data:`.exchange.IN_FLIGHT_BYTES` of
gradients wait for the link, so a ring slower than backprop holds backprop back rather than
every gradient. TensorFlow's own copies and glibc's heaps come on top: see BENCHMARKS.md
"Sharding".
Stage 3 (sharded weights, gathered layer by layer) is not here; docs/14-sharding.md.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import allreduce as ar
from keras.src.utils import tracking
from tensorflow.python.framework import func_graph

from ..collectives.dispatch import listed
from ..errors import tf_typed
from ..training.overlap import _submit_first
from ..training.mixed_precision import outside_loss_scale
from ..training.wrapping import WrappingOptimizer
from .checks import check_inner as _check_inner, from_tape as _from_tape
from . import exchange
from .exchange import ReduceScatters, check_same_model
from .gather import gather_into_model
from . import elastic
from .lamb import SegmentLamb
from .layout import shards
from .norms import clip_segments
from .state import GatheredState

__all__ = ["ShardedOptimizer", "ShardedOptimizerWrapper", "BUCKET_BYTES"]

BUCKET_BYTES = 1 << 20
"""Gradient bytes per reduce-scatter (and allgather) call, as the engine's buckets
(:data:`tfops.overlap.BUCKET_BYTES`): the first bucket's ring starts early in backprop. A
variable larger than this is a bucket of its own; the ring sends it in 256 KiB messages
(``allreduce.partition.MESSAGE_BYTES``)."""


def _shard_state_is_not_saved(store) -> None:
    """The inner optimizer's ``save_own_variables`` / ``load_own_variables``: the wrapper's write its state."""


@keras.saving.register_keras_serializable(package="tfops", name="ShardedOptimizer")
class ShardedOptimizerWrapper(WrappingOptimizer):
    """The wrapper :func:`ShardedOptimizer` returns; ``inner_optimizer`` updates this rank's segments."""

    def __init__(self, inner_optimizer, *, stage: int = 2, name=None, bucket_bytes: int | None = None,
                 clipnorm_of_model=None, global_clipnorm_of_model=None, process_set=None, **_ignored):
        _check_inner(inner_optimizer)
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer stage must be 1 (optimizer states) or 2 (and gradients), got "
                             f"{stage!r}; stage 3 (weights) is not implemented")
        super().__init__(learning_rate=0.0, name=name or f"Sharded{inner_optimizer.name}")
        self.stage = int(stage)
        self.bucket_bytes = bucket_bytes
        self.process_set = exchange.check_process_set(process_set)   # None: the world
        # the true norms are taken here, across shards (.norms): the inner optimizer must not clip a shard
        self.shard_clipnorm = clipnorm_of_model if clipnorm_of_model is not None else inner_optimizer.clipnorm
        self.shard_global_clipnorm = (global_clipnorm_of_model if global_clipnorm_of_model is not None
                                      else inner_optimizer.global_clipnorm)
        inner_optimizer.clipnorm = inner_optimizer.global_clipnorm = None
        if type(inner_optimizer) is keras.optimizers.Lamb:
            inner_optimizer = SegmentLamb.from_config(inner_optimizer.get_config())
        # the wrapper writes the whole state, gathered (.state); the inner's own would be this rank's shard
        inner_optimizer.save_own_variables = inner_optimizer.load_own_variables = _shard_state_is_not_saved
        self.inner_optimizer = inner_optimizer

    # -- layout: once, and again when the world changes (.elastic) -------------------------
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        var_list = list(var_list)
        if getattr(self, "_pending_state", None) is None:   # (a replacement joining a world: its peers are built)
            check_same_model(var_list, "ShardedOptimizer", comm=self._comm())
        self._model_vars = var_list
        inner = self.inner_optimizer
        self._excluded = set(getattr(inner, "_exclude_from_weight_decay", None) or ())   # AdamW's, model keys
        self._lay_out()
        super().build(var_list)

    def _comm(self):
        """The communicator the shards live on: the world's, or ``process_set``'s (ValueError outside it)."""
        return exchange.communicator_of(self.process_set)

    @tracking.no_automatic_dependency_tracking
    def _lay_out(self) -> None:
        """Segments of this rank (of this world size), the inner optimizer built over them, buffers."""
        comm = self._comm()
        var_list, rank, size = self._model_vars, comm.rank, comm.size
        self._shards = shards(var_list, rank, size, self.bucket_bytes or BUCKET_BYTES)
        for sh in self._shards:                           # a rank with no element would skip the step
            if sh.total < size:
                raise ValueError(f"ShardedOptimizer: {sh.total} {sh.dtype} elements are too few to shard over "
                                 f"{size} ranks (rank {size - 1} would own none)")
        segs = sorted((s for sh in self._shards for s in sh.segments), key=lambda s: (s.var, s.var_start))
        self._segments, self._seg_vars = segs, []
        for s in segs:
            model_var = var_list[s.var]
            with keras.name_scope(f"shard{s.var}", caller=self):
                self._seg_vars.append(keras.Variable(tf.zeros([s.size], model_var.dtype), dtype=model_var.dtype,
                                                     name=model_var.name.split("/")[-1].split(":")[0]))
        self._load_slices()
        inner = self.inner_optimizer
        if isinstance(inner, SegmentLamb):
            inner.owners, inner.n_vars, inner.comm = tuple(s.var for s in segs), len(var_list), comm
        if self._excluded:                                # the segments of excluded variables are excluded
            inner._exclude_from_weight_decay = set(self._excluded) | {
                inner._var_key(sv) for s, sv in zip(segs, self._seg_vars) if inner._var_key(var_list[s.var]) in self._excluded}
            inner._exclude_from_weight_decay_cache = {}
        inner.build(self._seg_vars)
        # both stages read TF's gradients (packing small ones); stage 2 bounds the gradients in flight
        self._exchange = ReduceScatters(self._shards, comm=comm, block_bytes=self.bucket_bytes or BUCKET_BYTES,
                                        in_flight_bytes=exchange.IN_FLIGHT_BYTES if self.stage == 2 else None)
        self._laid_out_for, self._state_view = (ar.rank(), ar.size()), None

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
        with tf.init_scope():                             # eager even while model.fit traces its train function
            elastic.reshard_if_needed(self)               # after an elastic reset: a new world, a new layout
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
                                  clipnorm=self.shard_clipnorm, global_clipnorm=self.shard_global_clipnorm,
                                  comm=self._comm())
        self._load_slices()
        self.inner_optimizer.apply(seg_grads, self._seg_vars)
        self._gather_into_model()

    def _load_slices(self) -> None:
        for s, sv in zip(self._segments, self._seg_vars):
            sv.assign(tf.reshape(self._model_vars[s.var], [-1])[s.var_start:s.var_start + s.size])

    def _reduce_scatter(self, grads) -> list:
        """Each bucket's gradients handed to the reduce-scatter thread as soon as backprop has them
        (one submit op per bucket, :func:`tfops.overlap._submit_first` in a ``tf.function``), then
        one wait op for every bucket's part: this rank's slice of the averaged gradients, one
        tensor per segment."""
        pending, groups, tokens = self._exchange, [], []
        for k, sh in enumerate(self._shards):
            for b, bk in enumerate(sh.buckets):           # backprop order: the last variables' bucket first
                def submit(*arrays, k=k, b=b, first=not tokens):
                    return np.int32(pending.submit(list(arrays), k, b, first=first))
                xs = [tf.cast(tf.convert_to_tensor(grads[v]), sh.dtype) for v in bk.vars]
                tokens.append(tf.numpy_function(tf_typed(submit), xs, tf.int32, stateful=True, name="tfops_shard_rs"))
                groups.append(xs)
        where = [(next(k for k, sh in enumerate(self._shards) if s.var in sh.vars), s) for s in self._segments]
        parts = tf.numpy_function(tf_typed(lambda *_tokens: pending.wait(where)), tokens,
                                  [tf.as_dtype(sv.dtype) for sv in self._seg_vars], stateful=True,
                                  name="tfops_shard_rs_wait")
        if len(tokens) > 1 and isinstance(tf.compat.v1.get_default_graph(), func_graph.FuncGraph):
            _submit_first(groups, [t.op for t in tokens])
        parts = listed(parts)
        for s, part in zip(self._segments, parts):
            part.set_shape([s.size])
        return parts

    def _gather_into_model(self) -> None:
        gather_into_model(self._shards, self._segments, self._seg_vars, self._model_vars, comm=self._comm())

    # -- checkpoints: the whole state, gathered (.state) ------------------------------------
    def _gathered(self) -> GatheredState:
        if getattr(self, "_state_view", None) is None:
            self._state_view = GatheredState(self)
        return self._state_view

    def save_own_variables(self, store):
        """Write the optimizer state as a plain optimizer would, slots gathered whole (every rank calls)."""
        self._gathered().save_to(store)

    def load_own_variables(self, store):
        """Read a plain layout (any rank count, or a plain optimizer's) into this rank's segments."""
        if not self.built:
            raise ValueError("ShardedOptimizer: build it (optimizer.build(model.trainable_variables)) before loading")
        self._gathered().load_from(store)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint" or not self.built:
            return super()._trackable_children(save_type, **kwargs)
        return self._gathered().trackable_children()

    def elastic_save(self) -> list:
        """For ``tfops.elastic.TensorFlowKerasState``: the whole state, gathered (collective)."""
        return elastic.save(self)

    def elastic_restore(self, values: list) -> None:
        """For ``tfops.elastic.TensorFlowKerasState``: load ``values`` at the next step, re-sharded."""
        elastic.restore(self, values)

    # -- what belongs to the inner optimizer ---------------------------------------------
    @property
    def variables(self):
        """What every rank holds alike: the inner optimizer's scalars (iteration, learning rate).
        A broadcast from rank 0 (BroadcastGlobalVariablesCallback) or a comparison across ranks
        may touch them; this rank's slots, different on every rank, are ``inner_optimizer.variables``."""
        return [v for v in self.inner_optimizer.variables if len(v.shape) == 0]

    def finalize_variable_values(self, var_list):
        pass                                              # no EMA (refused in __init__)

    def get_config(self):
        return {"name": self.name, "stage": self.stage, "bucket_bytes": self.bucket_bytes,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "clipnorm_of_model": self.shard_clipnorm, "global_clipnorm_of_model": self.shard_global_clipnorm}


def ShardedOptimizer(optimizer, stage: int = 2, *, name: str | None = None, bucket_bytes: int | None = None,
                     process_set=None):
    """Wrap a Keras 3 optimizer so each rank keeps and updates only its 1/p shard (ZeRO stage 1 or 2).

    Use it where :func:`tfops.DistributedOptimizer` goes: ``model.compile(optimizer=...,
    jit_compile=False)``, or ``apply_gradients`` / ``apply`` in a custom loop (eager or in a
    ``tf.function``). It takes each rank's *local* gradients and exchanges them itself
    (reduce-scatter, then allgather of the updated weights: the bytes of one allreduce), so never
    combine it with :class:`tfops.DistributedGradientTape`: its gradients raise ``ValueError``
    (eager, and inside a ``tf.function``).

    Args:
        optimizer: a Keras 3 optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop,
            Adagrad, Adamax, Nadam, Lion, Adadelta, Ftrl) or Lamb (its per-variable norms are
            reduced across shards). ``clipnorm`` and ``global_clipnorm`` clip by the true norms.
            Adafactor and Muon raise ``TypeError``: they need whole matrices.
        stage: 1 shards the optimizer's slots; 2 (default) also keeps only this rank's slice
            of the averaged gradient; 3 steps the pieces of a model wrapped by
            :func:`tfops.fully_shard` (the weights sharded too: :mod:`.stage3`).
        name: the wrapper's name; default ``"Sharded" + optimizer.name``.
        bucket_bytes: gradient bytes per reduce-scatter call (default :data:`BUCKET_BYTES`,
            1 MiB); every rank must pass the same value.
        process_set: shard over, and reduce over, this registered :class:`tfops.ProcessSet`
            only (default: every rank), e.g. a ``tfops.parallel.Mesh``'s ``data_set``: each set
            is its own data-parallel group with its own shards. Only the set's members may
            build it (``ValueError`` elsewhere). Not kept by ``get_config``: pass it again.

    Returns:
        A ``keras.optimizers.Optimizer``. Every rank must build it over the same variables, in
        the same order (else ``MismatchError`` on every rank before the first step), and every
        variable needs a gradient each step. Its ``variables`` are the scalars every rank holds
        alike (so ``BroadcastGlobalVariablesCallback`` leaves the shards alone); this rank's
        slots are ``inner_optimizer.variables``. Saving is a collective: every rank calls
        ``model.save`` / ``Checkpoint.write`` (the file holds the whole state, gathered). For a
        ``keras.optimizers.LossScaleOptimizer(opt)``: ``LossScaleOptimizer(ShardedOptimizer(opt))``,
        whose overflow check every rank answers alike (:mod:`tfops.training.mixed_precision`).
    """
    if stage == 3:                                        # the weights too: a model tfops.fully_shard wrapped
        from .stage3 import FullyShardedOptimizer
        if process_set is not None:
            raise ValueError("ShardedOptimizer(stage=3) shards over the ranks tfops.fully_shard(model, "
                             "process_set=...) was given; pass the process set there")
        return FullyShardedOptimizer(optimizer, name=name)
    return outside_loss_scale(optimizer, lambda inner: ShardedOptimizerWrapper(
        inner, stage=stage, name=name, bucket_bytes=bucket_bytes, process_set=process_set))
