"""How a split layer's slice of a weight gets its first values, and how the full weight is read
back and written: the shared machinery of every layer in tfops.parallel.

Two ways to initialise (``init=`` on every layer):

``"sliced"`` (the default)
    Every rank draws the *full* matrix with the layer's initializer, as the plain Keras layer would
    draw it, and keeps its slice (Megatron's ``_initialize_affine_weight_cpu``). Built after the same
    ``keras.utils.set_random_seed`` and in the same order, tensor = 1, 2 and 4 start from the same
    model. Costs the full matrix's memory on every rank for a moment.
``"per_rank"``
    Every rank draws only its own slice, never the full matrix (Megatron's GPU initialisation): the
    same distribution (a variance-scaling initializer, Glorot's or He's, keeps the *full* shape's
    fans), a different seed per tensor rank (the same seed on every data rank, so data replicas stay
    identical). The model differs from the plain one's draw; use it when the full matrix does not fit.

Full weights: ``get_full_weights()`` allgathers each split weight over the tensor group (eagerly,
once per weight); ``set_full_weights(list)`` checks every shape on every rank of the group first (a
wrong shape on any rank raises :class:`~tfops.parallel.errors.ShapeError` on all of them), then each
rank keeps its slice. Build-time agreement (:func:`agree`) makes ranks of one tensor group built
with different layer shapes fail together with ``MismatchError``.
"""
from __future__ import annotations

import random
import types

import keras
import numpy as np

from ..collectives.dispatch import in_step
from ..collectives.process_sets import communicator_of
from .errors import MismatchError, ShapeError

__all__ = ["LOCAL", "mesh_or_default", "initial_slice", "agree", "gather_full", "check_full_shapes", "slice_of",
           "divide"]

LOCAL = types.SimpleNamespace(tensor=1, tensor_rank=0, data=1, data_rank=0, pipeline=1, pipeline_rank=0,
                              tensor_set=None, data_set=None, pipeline_set=None)
"""The layout of ``mesh=None`` before any Mesh is built: one tensor rank, no collectives."""


def mesh_or_default(mesh):
    """``mesh``, else the last :class:`~tfops.parallel.Mesh` built on this rank, else :data:`LOCAL`."""
    if mesh is not None:
        return mesh
    from .mesh import Mesh
    return Mesh.last if Mesh.last is not None else LOCAL


def divide(n: int, mesh, what: str) -> int:
    """``n / tensor``, or a :class:`ShapeError` naming ``what`` (the same on every rank: all hold ``n``)."""
    if n % mesh.tensor:
        raise ShapeError(f"{what} = {n} is not divisible by the tensor size {mesh.tensor} (tensor rank "
                         f"{mesh.tensor_rank}); pick a multiple of {mesh.tensor}")
    return n // mesh.tensor


def slice_of(full, axis: int, mesh):
    """This tensor rank's part of ``full`` along ``axis`` (equal parts)."""
    part = full.shape[axis] // mesh.tensor
    index = [slice(None)] * len(full.shape)
    index[axis] = slice(part * mesh.tensor_rank, part * (mesh.tensor_rank + 1))
    return full[tuple(index)]


def _per_rank_initializer(initializer, full_shape, local_shape, mesh):
    """An initializer that draws ``local_shape`` from the full weight's distribution, seeded per tensor rank."""
    seed = random.randint(1, 2 ** 30) + 7919 * mesh.tensor_rank     # python's random: set_random_seed seeds it
    config = initializer.get_config()
    if "seed" not in config:                          # Zeros, Ones, Constant: nothing random
        return initializer
    if isinstance(initializer, keras.initializers.VarianceScaling):   # Glorot, He, LeCun: keep the full fans
        def fans(shape):
            rf = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
            fan_in = shape[-2] * rf if len(shape) > 1 else shape[0]
            fan_out = shape[-1] * rf
            return {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[initializer.mode]
        return keras.initializers.VarianceScaling(scale=initializer.scale * fans(local_shape) / fans(full_shape),
                                                  mode=initializer.mode, distribution=initializer.distribution,
                                                  seed=seed)
    config["seed"] = seed
    return initializer.__class__.from_config(config)


def initial_slice(initializer, full_shape, axis, mesh, init: str):
    """A Keras initializer for this rank's slice (``axis=None``: a replicated weight, drawn whole)."""
    initializer = keras.initializers.get(initializer)
    if axis is None or mesh.tensor == 1:
        return initializer
    if init == "sliced":
        return lambda shape, dtype=None: slice_of(initializer(tuple(full_shape), dtype=dtype), axis, mesh)
    if init == "per_rank":
        local = list(full_shape)
        local[axis] //= mesh.tensor
        return _per_rank_initializer(initializer, tuple(full_shape), tuple(local), mesh)
    raise ValueError(f"init must be 'sliced' or 'per_rank', got {init!r}")


def _comm(mesh):
    return None if mesh.tensor == 1 else communicator_of(mesh.tensor_set)


def agree(layer_name: str, description: dict, mesh) -> None:
    """Raise ``MismatchError`` on every rank of the tensor group if their layers' shapes differ."""
    comm = _comm(mesh)
    if comm is None:
        return
    every = in_step(comm.allgather_object, comm)(description)
    if any(d != every[0] for d in every):
        table = "; ".join(f"tensor rank {r}: {d}" for r, d in enumerate(every))
        raise MismatchError(f"{layer_name}: ranks of one tensor group built different layers ({table}); every "
                            "rank of a tensor group must build the same model")


def gather_full(value, axis, mesh) -> np.ndarray:
    """The full weight: every tensor rank's slice of ``value`` joined along ``axis`` (eager)."""
    value = np.asarray(value)
    comm = _comm(mesh)
    if comm is None or axis is None:
        return value
    rows = in_step(comm.allgather, comm)(np.ascontiguousarray(np.moveaxis(value, axis, 0)))
    return np.moveaxis(rows, 0, axis)


def check_full_shapes(layer_name: str, given: list, wanted: list, mesh) -> None:
    """Every rank of the tensor group checks the full weights it was given; any wrong shape raises everywhere."""
    problem = ""
    if len(given) != len(wanted):
        problem = f"{len(given)} arrays given, {len(wanted)} expected ({wanted})"
    else:
        for i, (g, w) in enumerate(zip(given, wanted)):
            if tuple(np.shape(g)) != tuple(w):
                problem = f"weight {i} has shape {tuple(np.shape(g))}, expected {tuple(w)}"
                break
    comm = _comm(mesh)
    every = [problem] if comm is None else in_step(comm.allgather_object, comm)(problem)
    bad = [(r, p) for r, p in enumerate(every) if p]
    if bad:
        raise ShapeError(f"{layer_name}.set_full_weights: " + "; ".join(f"tensor rank {r}: {p}" for r, p in bad)
                         + ". Pass the plain Keras layer's weights (layer.get_weights() order and shapes)")


class SplitLayer(keras.layers.Layer):
    """A Keras layer whose weights are split over the tensor group: the full-weight reading and writing.

    A subclass registers each weight with :meth:`_register` (variable, split axis or ``None`` for a
    replicated weight, full shape, rows of padding at the end of the split axis) in the plain Keras
    layer's ``get_weights()`` order.
    """

    def __init__(self, mesh=None, init: str = "sliced", **kwargs):
        super().__init__(**kwargs)
        if init not in ("sliced", "per_rank"):
            raise ValueError(f"init must be 'sliced' or 'per_rank', got {init!r}")
        self.mesh, self.init = mesh_or_default(mesh), init
        self._parts: list = []
        self.sequence_parallel_weights: list = []   # replicated, but each rank's gradient covers only its sequence part

    def _register(self, variable, axis, full_shape, pad: int = 0):
        self._parts.append((variable, axis, tuple(full_shape), pad))
        return variable

    def _full_shapes(self) -> list:
        return [shape for _, _, shape, _ in self._parts]

    def get_full_weights(self) -> list:
        """The weights of the plain Keras layer this one splits, in its ``get_weights()`` order."""
        out = []
        for variable, axis, shape, pad in self._parts:
            full = gather_full(variable.numpy(), axis, self.mesh)
            out.append(full[:shape[0]] if pad else full)
        return out

    def set_full_weights(self, weights: list) -> None:
        """Load the plain layer's weights (``get_weights()`` order and shapes); each rank keeps its slice."""
        check_full_shapes(type(self).__name__, list(weights), self._full_shapes(), self.mesh)
        for (variable, axis, shape, pad), full in zip(self._parts, weights):
            full = np.asarray(full, dtype=variable.dtype)
            if pad:
                full = np.concatenate([full, np.zeros((pad,) + full.shape[1:], full.dtype)])
            variable.assign(full if axis is None else slice_of(full, axis, self.mesh))
