"""CUDA device arrays: recognising them, choosing the GPU, and moving their bytes.

:mod:`allreduce.buffers` decides host versus device (``is_device_array``)
and hands device arrays here. :func:`allreduce` takes one of four paths:

* **p == 1** (or nothing to reduce): only Average's divide, on the device.
* **direct**, with CUDA-aware MPI (:func:`cuda_aware_mpi`, or
  ``ALLREDUCE_CUDA_AWARE_MPI=1``), the MPI transport, algorithm ``auto`` or
  ``mpi`` and a dtype MPI reduces exactly (float32/64, int32/64, uint8): the buffer goes
  straight to ``MPI_Allreduce``; Average's divide runs on the device.
* **CUDA IPC** (``cuda_ipc=True`` / ``ALLREDUCE_CUDA_IPC=1``; all ranks on
  one node, one process each): every rank maps its peers' device buffers
  and reduces its slice straight from them (:mod:`.ipc`). If any
  rank cannot, all fall back to staging, with one warning naming why.
* **staging** (always available): copy the device buffer to a pinned host
  buffer in segments on a stream, run the host algorithm on the host copy,
  copy the result back in segments. The copies overlap the messages::

      stream   D2H seg0 | D2H seg1 | D2H seg2 | ...               H2D seg0 | seg1 ...
      host              send seg0 | send seg1 | send seg2 | ... (algorithm)

  A send of host segment k waits only for the event of D2H copy k, so the
  copy of k+1 runs while k is on the wire (:mod:`.staging`).

Results come back on the input's device and as the input's type: CuPy in,
CuPy out; numba in, numba out; a TensorFlow GPU tensor (through DLPack and
CuPy) in, a TensorFlow tensor out. bfloat16 has no dtype in numba or CuPy:
wrap a ``uint16`` device array as ``Typed(x, ar.bfloat16)``.

The package has one module per concept:

    arrays       recognising device arrays (CuPy, numba, __cuda_array_interface__,
                 DLPack), ``Typed``, and returning results in the input's type
    selection    how many GPUs, and which one a rank uses
    cuda_aware   is MPI CUDA-aware, and does a buffer go to it directly
    staging      pinned-host staging, copies overlapping the messages
    ipc          CUDA IPC on one node
    dispatch     :func:`allreduce`: checks, per-communicator resources, the path taken
"""
from __future__ import annotations

from .arrays import Typed, is_device_array
from .cuda_aware import cuda_aware_mpi, direct_mpi, parse_ompi_info
from .dispatch import allreduce
from .selection import choose_device, num_devices, select_device
from .staging import DeviceStaging, StagedTransport

__all__ = ["Typed", "is_device_array", "num_devices", "choose_device", "select_device",
           "cuda_aware_mpi", "parse_ompi_info", "direct_mpi", "DeviceStaging", "StagedTransport", "allreduce"]
