"""CUDA-aware MPI: can MPI read device memory, and should a device buffer go to it directly?

:func:`cuda_aware_mpi` asks the loaded libmpi (``MPIX_Query_cuda_support``)
and, for Open MPI without that symbol, ``ompi_info`` (:func:`parse_ompi_info`);
``ALLREDUCE_CUDA_AWARE_MPI`` (``Config.cuda_aware_mpi``) forces the answer.
:func:`direct_mpi` then decides the "direct" path: the device buffer goes
straight to ``MPI_Allreduce`` with no staging copy.
"""
from __future__ import annotations

import ctypes
import functools
import re
import shutil
import subprocess

import numpy as np

from ..transport.base import Transport

__all__ = ["parse_ompi_info", "cuda_aware_mpi", "direct_mpi"]

_OMPI_CUDA = re.compile(r"^mca:\w+:base:param:(?:mpi|opal)_built_with_cuda_support:value:(\w+)", re.M)


def parse_ompi_info(text: str) -> bool | None:
    """``ompi_info --parsable --all`` output -> built with CUDA support? (None: not stated)."""
    found = _OMPI_CUDA.findall(text)
    return None if not found else any(v.lower() == "true" for v in found)


def _query_mpix() -> bool | None:
    """``MPIX_Query_cuda_support()`` from the loaded libmpi (Open MPI >= 2, MPICH >= 4)."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if re.search(r"/libmpi\.so", line)}
        for path in sorted(libs):
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
            if fn is not None:
                return bool(fn())
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi(setting: str = "auto") -> bool:
    """Can MPI send from and receive into device memory? ``setting`` "1"/"0" forces the answer."""
    if setting in ("1", "0"):
        return setting == "1"
    answer = _query_mpix()
    if answer is not None:
        return answer
    from mpi4py import MPI                                 # only to name the library
    if "Open MPI" in MPI.Get_library_version() and shutil.which("ompi_info"):
        try:
            out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                                 text=True, timeout=20).stdout
            return bool(parse_ompi_info(out))
        except (OSError, subprocess.SubprocessError):
            return False
    return False


_MPI_REDUCES = ("float32", "float64", "int32", "int64")   # not fp16/bf16; 8- and 16-bit: Open MPI saturates


def direct_mpi(config, transport: Transport, dtype: np.dtype, algorithm: str) -> bool:
    """Hand the device buffer straight to ``MPI_Allreduce``? Only with CUDA-aware MPI, the MPI
    transport, ``algorithm`` "auto" or "mpi", and a dtype MPI reduces exactly (``_MPI_REDUCES``)."""
    return (algorithm in ("auto", "mpi") and np.dtype(dtype).name in _MPI_REDUCES
            and type(getattr(transport, "comm", None)).__module__.startswith("mpi4py")
            and cuda_aware_mpi(config.cuda_aware_mpi))
