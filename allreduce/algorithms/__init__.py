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

__all__ = ["get", "NAMES"]

_MODULES = {"ring": "ring", "tree": "tree", "rhd": "rhd", "rd": "rd", "mpi": "native",
            "shm": "shm", "hierarchical": "hierarchical"}
NAMES = tuple(_MODULES)
_LOADED: dict[str, Callable] = {}     # import_module costs microseconds per call: resolve once


def get(name: str) -> Callable:
    """The ``allreduce`` function of algorithm ``name``."""
    run = _LOADED.get(name)
    if run is None:
        if name not in _MODULES:
            raise ValueError(f"unknown algorithm {name!r}; choose one of: auto, {', '.join(NAMES)}")
        run = _LOADED[name] = importlib.import_module(f".{_MODULES[name]}", __name__).allreduce
    return run
