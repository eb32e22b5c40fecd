"""Choosing the GPU: how many this process sees, and which one a rank uses.

Several ranks may share a GPU (``local_rank % count``), and
``ALLREDUCE_DEVICE`` (``Config.device``) overrides the choice.
:func:`select_device` makes the choice current for numba and CuPy alike;
call it once at start-up, before allocating device arrays.
"""
from __future__ import annotations

from numba import cuda

from ..errors import InvalidArgumentError
from ..kernels import cuda as dk

__all__ = ["num_devices", "choose_device", "select_device"]


def num_devices() -> int:
    """GPUs this process can see (0 without a driver)."""
    cp = dk._cupy()
    if cp is not None and not dk.SIMULATED:
        return cp.cuda.runtime.getDeviceCount()
    try:
        return len(cuda.gpus) if dk.SIMULATED or cuda.is_available() else 0
    except Exception:                                      # noqa: BLE001 - no driver: no GPU
        return 0


def choose_device(local_rank: int, *, override: int = -1, count: int | None = None) -> int:
    """``override`` if set (>= 0), else ``local_rank % count``: several ranks may share a GPU."""
    count = num_devices() if count is None else count
    if count <= 0:
        raise InvalidArgumentError("no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES)")
    if override >= 0:
        if override >= count:
            raise InvalidArgumentError(f"ALLREDUCE_DEVICE={override}, but only {count} GPU(s) are visible")
        return override
    return local_rank % count


def select_device(local_rank: int, *, override: int = -1) -> int:
    """Make ``choose_device(...)`` this thread's current GPU (numba and CuPy); return its id.

    Call it once at start-up, before allocating device arrays, e.g.
    ``ar.device.select_device(ar.local_rank(), override=ar.communicator().config.device)``.
    """
    dev = choose_device(local_rank, override=override)
    if not dk.SIMULATED:
        if cuda.is_available():                           # numba's driver: staging copies, kernels
            cuda.select_device(dev)
        cp = dk._cupy()
        if cp is not None:
            cp.cuda.Device(dev).use()
    return dev
