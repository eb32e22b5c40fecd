"""What the tape and the optimizer do with one step's gradients, Horovod's way.

::

    gradients ──┬── of local sources ─────────────── / size ──────────────┐   (not reduced)
                └── the rest ── split into groups ── each group: one     ─┴── in source order
                                                      grouped_allreduce

* **Local sources** (``register_local_var``, ``register_local_source``,
  ``Partial*``): their gradients stay on this rank, divided by ``size()``
  (Horovod's ``scale_local_gradients=True``: the update then has the scale of
  an averaged one).
* **gradient_predivide_factor** ``f`` (``op=Average`` only): each gradient is
  multiplied by ``1/f`` before the sum and the sum by ``f/size`` after it,
  so that a large sum of low-precision gradients cannot overflow; ``f = 1``
  is the plain average.
* **Groups**: ``num_groups=n`` splits the reduced gradients, in order, into
  ``n`` nearly equal groups; ``groups=[[v, ...], ...]`` names them by variable
  (gradients of variables in no group get a group each). Every group is one
  grouped allreduce (:func:`tfops.training.gradients.reduce_gradients`), so the
  engine negotiates and fuses it as one tensor. Default: one group, eagerly; inside a graph
  (``tf.function``, ``model.fit``) buckets of about 1 MiB in backprop order, each submitted as
  soon as its gradients exist, all waited for once (:mod:`tfops.training.overlap`).

* **comm_hook** (``tfops.PowerSGD``, ``tfops.OneBit``): the same groups and buckets, each
  reduced by the hook instead of the plain allreduce (every array its own engine tensor, so
  the hook sees each gradient's shape); the engine hands the hook the tensors that are ready
  together as one bucket. Not with ``compression``, Adasum, a predivide or a process set.

Cost: one grouped allreduce per group, of the non-local gradients' bytes;
the predivide adds two elementwise scalings.
"""
from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

import allreduce as ar

from .gradients import reduce_gradients
from ..collectives.compression import Compression, check_comm_hook, check_compression
from ..collectives.dispatch import Adasum, Average

__all__ = ["GradientSettings", "reduce_step", "source_key", "gradient_names"]


def gradient_names(prefix: str, count: int) -> list[str]:
    """Cross-rank names for one step's gradients: by position, as Horovod names them.

    Positions, not variable names: Keras numbers layers per process (``dense_3``), so a rank
    that built one more model would otherwise never match its peers. A different variable set
    on one rank shows up as a shape ``MismatchError`` or, for extra variables, a stall.
    """
    return [f"{prefix}.grad.{i}" for i in range(count)]


def source_key(source) -> int:
    """Identity of a variable across its wrappers: a Keras 3 variable and the tf.Variable under it agree."""
    if isinstance(source, keras.Variable):
        source = source.value
    return id(source)


@dataclasses.dataclass
class GradientSettings:
    """One tape's or optimizer's reduction settings (validated once, in :meth:`check`)."""
    op: object = Average
    compression: object = Compression.none
    comm_hook: object = None
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    num_groups: int = 0
    groups: list | None = None
    process_set: object = None
    scale_local_gradients: bool = True
    local: dict = dataclasses.field(default_factory=dict)   # source_key -> the source (kept alive)

    def check(self, who: str) -> "GradientSettings":
        self.compression = check_compression(self.compression)
        self.gradient_predivide_factor = float(self.gradient_predivide_factor)
        if self.gradient_predivide_factor <= 0:
            raise ValueError(f"{who}: gradient_predivide_factor must be > 0, got {self.gradient_predivide_factor}")
        if self.gradient_predivide_factor != 1.0 and self.op != Average:
            raise ValueError(f"{who}: gradient_predivide_factor is only supported with op=Average (Horovod's "
                             f"rule), got op={self.op!r}")
        if self.num_groups and self.groups is None:
            self.groups = self.num_groups          # Horovod: num_groups is the older name of groups=int
        if self.groups is not None and not isinstance(self.groups, list) and int(self.groups) <= 0:
            raise ValueError(f"{who}: groups (num_groups) must be a positive integer or a list of lists of "
                             f"variables, got {self.groups!r}")
        self.comm_hook = check_comm_hook(self.comm_hook, who)
        if self.comm_hook is not None:
            self._check_hook(who)
        return self

    def _check_hook(self, who: str) -> None:
        """What a communication hook cannot be combined with: it replaces the allreduce, so the
        compressor, Adasum's own algorithm and the predivide's two scalings have no place in it."""
        if self.compression is not Compression.none:
            raise ValueError(f"{who}: pass comm_hook= or compression=, not both (got {self.comm_hook!r} and "
                             f"{self.compression!r}); a hook decides what goes on the wire")
        if self.op == Adasum:
            raise ValueError(f"{who}: comm_hook= does not combine with op=Adasum (Adasum is its own algorithm)")
        if self.gradient_predivide_factor != 1.0:
            raise ValueError(f"{who}: comm_hook= does not combine with gradient_predivide_factor="
                             f"{self.gradient_predivide_factor:g} (a hook reduces the gradients itself)")
        if self.process_set is not None:
            from ..collectives.process_sets import is_global
            if not is_global(self.process_set):
                raise ValueError(f"{who}: comm_hook= reduces over all ranks; it does not take a process_set")

    def register_local(self, source) -> None:
        self.local[source_key(source)] = source


def _split(indices: list[int], n: int) -> list[list[int]]:
    """``indices`` in ``n`` contiguous parts whose lengths differ by at most one (Horovod's split_list)."""
    n = max(1, min(n, len(indices)))
    size, extra = divmod(len(indices), n)
    parts, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(indices[start:end])
        start = end
    return parts


def _groups_of(settings: GradientSettings, indices: list[int], sources: list) -> list[list[int]]:
    if settings.groups is None:
        return [indices] if indices else []
    if not isinstance(settings.groups, list):
        return _split(indices, int(settings.groups))
    position = {source_key(sources[i]): i for i in indices}
    parts = []
    for group in settings.groups:
        part = [position.pop(source_key(v)) for v in group if source_key(v) in position]
        if part:
            parts.append(sorted(part))
    return parts + [[i] for i in sorted(position.values())]


def _scale(g, factor: float):
    if factor == 1.0 or g is None:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def _reduce_group(grads: list, names: list[str], settings: GradientSettings) -> list:
    op, f = settings.op, settings.gradient_predivide_factor
    if settings.process_set is not None:
        from ..collectives.process_sets import grouped_allreduce_in_set, is_global
        if not is_global(settings.process_set):
            if settings.process_set.included() is False:
                # Horovod's rule (its _allreduce_cond): a rank outside the set keeps its own gradients
                return list(grads)
            pre, post = (1.0 / f, f) if op == Average else (1.0, 1.0)
            dense = [tf.convert_to_tensor(g) if settings.sparse_as_dense and isinstance(g, tf.IndexedSlices)
                     else g for g in grads]
            return grouped_allreduce_in_set(dense, op=op, prescale_factor=pre, postscale_factor=post,
                                            process_set=settings.process_set)
    if f == 1.0:        # the default single group: buckets overlapping backprop (tfops.training.overlap)
        return reduce_gradients(grads, names, op=op, compression=settings.compression,
                                sparse_as_dense=settings.sparse_as_dense, overlap=settings.groups is None,
                                comm_hook=settings.comm_hook)
    # Average with a predivide: (1/f) before the sum, f/size after it (Horovod's pre/postscale split).
    summed = reduce_gradients([_scale(g, 1.0 / f) for g in grads], names, op=ar.Sum,
                              compression=settings.compression, sparse_as_dense=settings.sparse_as_dense)
    return [_scale(g, f / ar.size()) for g in summed]


def reduce_step(grads: list, sources: list, settings: GradientSettings, prefix: str) -> list:
    """One step's gradients (aligned with ``sources``) reduced as the module docstring says.

    Args:
        grads: tensors, ``tf.IndexedSlices`` or ``None`` (kept ``None``).
        sources: the variables (or tensors) the gradients belong to, same length.
        settings: the caller's :class:`GradientSettings`.
        prefix: cross-rank name prefix (``"tape"``, ``"optimizer"``): names are positions.

    Returns:
        The gradients in order: reduced, or for local sources divided by ``size()``.
    """
    out = list(grads)
    size = ar.size()
    if size == 1:
        return out              # reducing over one rank is the identity, local or not
    names = gradient_names(prefix, len(out))
    reduced = []
    for i, g in enumerate(out):
        if g is None:
            continue
        if settings.local and source_key(sources[i]) in settings.local:
            if settings.scale_local_gradients:
                out[i] = _scale(g, 1.0 / size)
        else:
            reduced.append(i)
    for part in _groups_of(settings, reduced, sources):
        for i, y in zip(part, _reduce_group([out[i] for i in part], [names[i] for i in part], settings)):
            out[i] = y
    return out
