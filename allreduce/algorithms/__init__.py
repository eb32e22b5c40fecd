"""The allreduce algorithms, one per module, all with one signature::

    allreduce(comm: Transport, buf: np.ndarray, op: Op, *, workspace: Workspace,
              segment_bytes: int) -> None       # reduces buf in place

=========  ===================================================  ================
name       idea                                                 best for
=========  ===================================================  ================
ring       reduce-scatter + allgather around a ring             large messages
tree       pipelined double binary tree: reduce, then bcast     latency, many p
rhd        recursive halving (reduce-scatter) then doubling      mid to large
rd         recursive doubling: exchange whole buffers            tiny messages
mpi        the MPI library's MPI_Allreduce                       reference, peer
shm        one node: reduce slices straight from shared memory   one node, large
hierarchical  shm inside each node, ring/tree across leaders     many nodes
=========  ===================================================  ================

``get(name)`` imports the module on first use, so the in-process transport
never loads MPI.
"""
from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["get", "run", "run_many", "NAMES", "READS_SRC", "MANY"]

_MODULES = {"ring": "ring", "tree": "tree", "rhd": "rhd", "rd": "rd", "mpi": "native",
            "shm": "shm", "hierarchical": "hierarchical"}
NAMES = tuple(_MODULES)
_LOADED: dict[str, Callable] = {}     # import_module costs microseconds per call: resolve once


#: Algorithms that take ``src=``: read the input there, write only ``buf``. An out-of-place call
#: (a new result array) then skips copying the whole input into the result first.
READS_SRC = frozenset({"shm"})


def run(name: str, comm, buf, op, *, workspace, segment_bytes: int, src=None) -> None:
    """Reduce into ``buf`` with algorithm ``name``: ``buf``'s own contents, or ``src``'s (left
    unchanged), which an algorithm outside :data:`READS_SRC` gets copied into ``buf`` first."""
    if src is None:
        get(name)(comm, buf, op, workspace=workspace, segment_bytes=segment_bytes)
    elif name in READS_SRC:
        get(name)(comm, buf, op, workspace=workspace, segment_bytes=segment_bytes, src=src)
    else:
        buf[...] = src
        get(name)(comm, buf, op, workspace=workspace, segment_bytes=segment_bytes)


#: Algorithms with an ``allreduce_many(comm, bufs, op, *, srcs)``: several arrays of one dtype in one
#: call, as if back to back (``shm`` streams its windows across them: one call's syncs, no packing).
MANY = frozenset({"shm"})


def run_many(name: str, comm, bufs: list, op, *, srcs: list) -> None:
    """Reduce every one of ``bufs`` (from ``srcs[i]`` where it is not None) in one call of algorithm
    ``name``'s many-form; only the algorithms in :data:`MANY` have one."""
    if name not in MANY:
        raise ValueError(f"algorithm {name!r} reduces one buffer per call; these take several: {', '.join(sorted(MANY))}")
    importlib.import_module(f".{_MODULES[name]}", __name__).allreduce_many(comm, bufs, op, srcs=srcs)


def get(name: str) -> Callable:
    """The ``allreduce`` function of algorithm ``name``."""
    run = _LOADED.get(name)
    if run is None:
        if name not in _MODULES:
            raise ValueError(f"unknown algorithm {name!r}; choose one of: auto, {', '.join(NAMES)}")
        run = _LOADED[name] = importlib.import_module(f".{_MODULES[name]}", __name__).allreduce
    return run
