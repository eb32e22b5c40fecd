"""Device support on a real CUDA GPU: kernels, staging with CuPy and numba arrays, CUDA IPC.

Skipped, with the reason, where no GPU is usable. ``scripts/gpu_check.sh``
runs the same checks (and a busbw sweep) on a GPU machine.
"""
import numpy as np
import pytest
from numba.core import config as numba_config

from allreduce import kernels
from allreduce.comm import Communicator
from allreduce.config import Config
from allreduce.kernels import cuda as dk
from allreduce.ops import SUPPORTED_DTYPES, Op, bfloat16
from allreduce.transport.threads import run_threads

from .harness import assert_allreduce_ok, make_inputs, mpirun

GPU = not numba_config.ENABLE_CUDASIM and dk.backend() is not None
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU: no CUDA driver/device or no libNVVM/CuPy here "
                                               "(the simulator covers this logic in test_cuda_sim.py)")
needs_cupy = pytest.mark.skipif(not GPU or dk._cupy() is None,
                                reason="needs a CUDA GPU and CuPy (pip install cupy-cuda12x)")


def _store(dtype):
    return np.dtype(np.uint16) if np.dtype(dtype) == bfloat16 else np.dtype(dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_gpu_kernels_bitwise_equal_to_cpu(dtype):
    from numba import cuda
    rng = np.random.default_rng(5)
    for op in Op:
        a, b = make_inputs(rng, 2, 100_003, dtype, op)
        for p in (1, 4):
            want = a.copy()
            d, s = cuda.to_device(a.view(_store(dtype))), cuda.to_device(b.view(_store(dtype)))
            if p == 1:
                kernels.reduce_into(want, b, op)
                dk.reduce_into(d, s, op, dtype=dtype)
            else:
                kernels.reduce_finish_into(want, b, op, p)
                dk.reduce_finish_into(d, s, op, p, dtype=dtype)
            assert d.copy_to_host().tobytes() == want.view(_store(dtype)).tobytes(), f"{dtype} {op!r} p={p}"


@needs_cupy
@pytest.mark.parametrize("p", [2, 3, 4])
def test_gpu_staging_cupy_arrays_on_threads(p):
    cp = dk._cupy()
    inputs = make_inputs(np.random.default_rng(p), p, 10_001, np.float32, Op.AVERAGE)

    def body(transport):
        out = Communicator(transport, config=Config(segment_bytes=4096)).allreduce(
            cp.asarray(inputs[transport.rank]), Op.AVERAGE, algorithm="ring")
        assert isinstance(out, cp.ndarray)
        return cp.asnumpy(out)
    assert_allreduce_ok(run_threads(p, body), inputs, Op.AVERAGE)


@needs_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("path", ["staging", "ipc"])
def test_gpu_mpi_matrix(path):
    """2 ranks on one GPU: every dtype and op through the staging and the CUDA IPC paths."""
    result = mpirun(2, "cuda_allreduce.py", "--path", path, "--check", timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "failures=0" in result.stdout
