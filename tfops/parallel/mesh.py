"""The device mesh: which ranks split a layer (tensor), which split the batch (data), which hold
successive stages (pipeline). One object owns the process sets of every axis.

::

    mesh = Mesh(tensor=2, pipeline=1)        # world 8 -> data = 8 // (2 * 1) = 4

    global rank = pipeline_rank * (data * tensor) + data_rank * tensor + tensor_rank

    world 8, tensor 2, pipeline 2 (so data 2):
                    data 0      data 1
    pipeline 0    [ 0  1 ]    [ 2  3 ]        [a b] = one tensor group: consecutive ranks,
    pipeline 1    [ 4  5 ]    [ 6  7 ]        so it stays inside one node (Megatron's order:
                                             tensor fastest, pipeline slowest)
    tensor sets   {0,1} {2,3} {4,5} {6,7}
    data sets     {0,2} {1,3} {4,6} {5,7}     gradients are averaged over these only
    pipeline sets {0,4} {1,5} {2,6} {3,7}

Steps of ``Mesh(...)`` (collective: every rank builds the same meshes in the same order):

1. check the sizes on every rank: ``tensor * pipeline`` must divide the world
   (:class:`~tfops.parallel.errors.MeshError` on every rank, since all hold the same world size);
2. allgather ``(tensor, pipeline)`` so that ranks built with different sizes fail together
   (``MismatchError``) instead of registering sets that happen to line up;
3. register each axis's groups in a fixed order (tensor, data, pipeline; groups by their lowest
   rank). A group of every rank is the global set; a group already registered (by an earlier
   mesh) is reused, since the core refuses the same ranks twice.

Cost: one allgather of two integers, then one ``add_process_set`` (an allgather of the rank list and an
``MPI_Comm_create_group``) per new group: at most ``size/tensor + size/data + size/pipeline`` groups.
"""
from __future__ import annotations

import allreduce as ar
from allreduce.process_sets import ProcessSet, add_process_set, global_process_set, process_sets

from .errors import MeshError, MismatchError

__all__ = ["Mesh", "groups"]


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshError(f"Mesh: {name} must be a positive integer, got {value!r} (rank {ar.rank()})")
    return value


def _set_of(ranks: list[int]) -> ProcessSet:
    """The registered set with exactly these ranks (the global set for every rank), registering it if new."""
    if ranks == list(range(ar.size())):
        return global_process_set
    for existing in process_sets()[1:]:
        if existing.ranks == ranks:
            return existing
    return add_process_set(ranks)


def groups(axis: str, *, tensor: int, data: int, pipeline: int) -> list[list[int]]:
    """Every group of ``axis`` in a tensor x data x pipeline layout, as sorted world ranks, lowest first
    (a pure function: the layout arithmetic, testable without any process)."""
    sizes = {"tensor": tensor, "data": data, "pipeline": pipeline}
    if axis not in sizes:
        raise MeshError(f"Mesh.groups: axis must be 'tensor', 'data' or 'pipeline', got {axis!r}")
    out = []
    for p in range(pipeline):
        for d in range(data):
            for t in range(tensor):
                coords = {"tensor": t, "data": d, "pipeline": p}
                if coords[axis] != 0:
                    continue
                group = []
                for i in range(sizes[axis]):        # walk the axis from this group's first rank
                    coords[axis] = i
                    group.append(coords["pipeline"] * data * tensor + coords["data"] * tensor + coords["tensor"])
                out.append(sorted(group))
    return sorted(out)


class Mesh:
    """The tensor x data x pipeline layout of the ranks (Megatron's order; see the module docstring).

    Args:
        tensor: ranks that split each layer's weights (consecutive ranks).
        pipeline: ranks that hold successive stages of the model.

    ``data = size() // (tensor * pipeline)``. Every rank must build the same meshes in the same
    order (building one registers process sets, a collective over all ranks). Needs ``tfops.init()``.

    Attributes:
        tensor, data, pipeline: the sizes of the three axes.
        tensor_rank, data_rank, pipeline_rank: this rank's coordinates.
        tensor_set, data_set, pipeline_set: the :class:`tfops.ProcessSet` of this rank's group on
            each axis (a size-1 axis has a single-rank set; an axis over every rank is the global set).
    """

    last = None          # the last mesh built on this rank: what the layers' ``mesh=None`` means

    def __init__(self, *, tensor: int = 1, pipeline: int = 1):
        if not ar.is_initialized():
            raise MeshError("Mesh: call tfops.init() first")
        size = ar.size()
        tensor, pipeline = _positive("tensor", tensor), _positive("pipeline", pipeline)
        if size % (tensor * pipeline):
            raise MeshError(f"Mesh(tensor={tensor}, pipeline={pipeline}): tensor x pipeline = "
                            f"{tensor * pipeline} does not divide the world size {size} (rank {ar.rank()}); "
                            f"pick sizes whose product divides {size}")
        if size > 1:
            every = ar.allgather_object((tensor, pipeline))
            if any(v != every[0] for v in every):
                table = ", ".join(f"rank {r}: tensor={t} pipeline={p}" for r, (t, p) in enumerate(every))
                raise MismatchError(f"Mesh: ranks built different meshes ({table}); every rank must build "
                                    "the same meshes in the same order")
        self.tensor, self.pipeline, self.data = tensor, pipeline, size // (tensor * pipeline)
        rank = ar.rank()
        self.tensor_rank = rank % tensor
        self.data_rank = (rank // tensor) % self.data
        self.pipeline_rank = rank // (tensor * self.data)
        self.tensor_set = self.data_set = self.pipeline_set = None
        for axis in ("tensor", "data", "pipeline"):          # every rank registers every group, in this order
            for group in self.groups(axis):
                ps = _set_of(group)
                if rank in group:
                    setattr(self, f"{axis}_set", ps)
        Mesh.last = self

    def rank_of(self, tensor_rank: int | None = None, data_rank: int | None = None,
                pipeline_rank: int | None = None) -> int:
        """The global rank at these coordinates (``None``: this rank's own coordinate on that axis)."""
        t = self.tensor_rank if tensor_rank is None else tensor_rank
        d = self.data_rank if data_rank is None else data_rank
        p = self.pipeline_rank if pipeline_rank is None else pipeline_rank
        for name, value, bound in (("tensor_rank", t, self.tensor), ("data_rank", d, self.data),
                                   ("pipeline_rank", p, self.pipeline)):
            if not 0 <= value < bound:
                raise MeshError(f"Mesh.rank_of: {name}={value} is outside [0, {bound})")
        return p * (self.data * self.tensor) + d * self.tensor + t

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` ("tensor", "data" or "pipeline") as sorted world ranks, lowest first."""
        return groups(axis, tensor=self.tensor, data=self.data, pipeline=self.pipeline)

    def __repr__(self) -> str:
        return (f"Mesh(tensor={self.tensor}, data={self.data}, pipeline={self.pipeline}; this rank: "
                f"tensor_rank={self.tensor_rank}, data_rank={self.data_rank}, pipeline_rank={self.pipeline_rank})")
