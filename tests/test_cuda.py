"""Device support without a GPU: detection, device choice, settings, and the simulator run.

The kernels and the staging path are tested in ``test_cuda_sim.py`` under
numba's CUDA simulator, which must be enabled before numba is imported, so
:func:`test_simulator_suite` runs that file in a fresh pytest process.
Tests that need a real GPU are in ``test_cuda_gpu.py``.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from numba.core import config as numba_config

from allreduce import buffers, device
from allreduce.config import Config
from allreduce.errors import InvalidArgumentError

from .harness import ROOT

OMPI_4 = """mca:mpi:base:param:mpi_built_with_cuda_support:value:true
mca:mpi:base:param:mpi_built_with_cuda_support:source:default"""
OMPI_5 = """mca:opal:base:param:opal_built_with_cuda_support:value:false
mca:opal:base:param:opal_built_with_cuda_support:enumerator:value:1:true"""


def test_parse_ompi_info():
    assert device.parse_ompi_info(OMPI_4) is True
    assert device.parse_ompi_info(OMPI_5) is False          # the enumerator line is not the value
    assert device.parse_ompi_info("mca:btl:tcp:param:x:value:true") is None


def test_cuda_aware_mpi_detection_agrees_with_ompi_info():
    assert device.cuda_aware_mpi("1") is True and device.cuda_aware_mpi("0") is False
    answer = device.cuda_aware_mpi()
    assert isinstance(answer, bool)
    if shutil.which("ompi_info"):
        text = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True,
                              timeout=30).stdout
        stated = device.parse_ompi_info(text)
        if stated is not None:
            assert answer == stated


def test_choose_device_round_robin_and_override():
    assert [device.choose_device(r, count=2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert device.choose_device(3, count=1) == 0                    # several ranks share one GPU
    assert device.choose_device(0, override=1, count=2) == 1
    with pytest.raises(InvalidArgumentError, match="only 2 GPU"):
        device.choose_device(0, override=2, count=2)
    with pytest.raises(InvalidArgumentError, match="no CUDA device"):
        device.choose_device(0, count=0)


def test_device_settings_come_from_the_environment():
    config = Config.from_env({"ALLREDUCE_DEVICE": "1", "ALLREDUCE_CUDA_IPC": "1", "ALLREDUCE_CUDA_AWARE_MPI": "0"})
    assert (config.device, config.cuda_ipc, config.cuda_aware_mpi) == (1, True, "0")
    assert (Config().device, Config().cuda_ipc, Config().cuda_aware_mpi) == (-1, False, "auto")
    with pytest.raises(ValueError, match="cuda_aware_mpi"):
        Config(cuda_aware_mpi="yes")


def test_host_arrays_are_not_device_arrays():
    assert not buffers.is_device_array(np.ones(3))
    assert not buffers.is_device_array([1.0, 2.0])
    assert not buffers.is_device_array(3.0)


@pytest.mark.skipif(numba_config.ENABLE_CUDASIM, reason="already inside the simulator: test_cuda_sim.py runs here")
@pytest.mark.timeout(240)
def test_simulator_suite():
    """``tests/test_cuda_sim.py`` under NUMBA_ENABLE_CUDASIM=1, in its own process."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_cuda_sim.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"simulator tests failed:\n{tail}"
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail


def test_direct_mpi_only_for_cuda_aware_mpi_and_dtypes_mpi_reduces():
    from types import SimpleNamespace

    from mpi4py import MPI

    from allreduce.ops import bfloat16
    mpi = SimpleNamespace(comm=MPI.COMM_SELF)
    threads = SimpleNamespace()
    aware, unaware = Config(cuda_aware_mpi="1"), Config(cuda_aware_mpi="0")
    f32 = np.dtype(np.float32)
    assert device.direct_mpi(aware, mpi, f32, "auto") and device.direct_mpi(aware, mpi, f32, "mpi")
    assert not device.direct_mpi(unaware, mpi, f32, "auto")
    assert not device.direct_mpi(aware, threads, f32, "auto")          # no MPI communicator
    assert not device.direct_mpi(aware, mpi, f32, "ring")              # the user asked for ring
    assert not device.direct_mpi(aware, mpi, np.dtype(np.float16), "auto")
    assert not device.direct_mpi(aware, mpi, bfloat16, "mpi")
    assert not device.direct_mpi(aware, mpi, np.dtype(np.int8), "mpi")         # Open MPI saturates int8
    assert not device.direct_mpi(aware, mpi, np.dtype(np.uint8), "mpi")        # and uint8, int16, uint16


# -- the CuPy fallback's CUDA C, compiled as host C: its arithmetic is plain C99 -------------
_C_TYPES = {"float32": "float", "float64": "double", "int8": "signed char", "int32": "int",
            "int64": "long long", "uint8": "unsigned char", "uint16": "unsigned short", "int16": "short",
            "bool": "_Bool"}


def _cupy_bodies_as_host_library(tmp_path):
    """Each CuPy ElementwiseKernel body inside a host loop (``d``, ``s`` are the elements)."""
    from allreduce.kernels import cupy_fallback as dk
    src = ["#include <math.h>", "#define __device__", dk._C_ENCODE,
           "typedef unsigned short u16;",
           "void half_reduce(u16* dd, const u16* ss, long long count, long long n, int op, const float* table,"
           " int mant_bits, int bias, double overflow, int nan_bits) {",
           "  for (long long i = 0; i < count; i++) { u16 d = dd[i], s = ss[i]; {" + dk._C_HALF + "} dd[i] = d; } }",
           "void half_finish(u16* dd, long long count, long long n, const float* table, int mant_bits, int bias,"
           " double overflow, int nan_bits) {",
           "  for (long long i = 0; i < count; i++) { u16 d = dd[i];"
           " d = ar_encode((double)table[d] / n, mant_bits, bias, overflow, nan_bits); dd[i] = d; } }"]
    for name, ctype in _C_TYPES.items():
        src.append(f"typedef {ctype} T_{name};")
        bodies = dict(dk._C_NATIVE)
        if name.startswith(("int", "uint")):
            bodies[dk._AVG] = dk._C_INT_AVG
        for code, body in bodies.items():
            src.append(f"void native_{name}_{code}(T_{name}* dd, const T_{name}* ss, long long count, long long n) "
                       f"{{ typedef T_{name} T; for (long long i = 0; i < count; i++) "
                       f"{{ T d = dd[i], s = ss[i]; {{ {body}; }} dd[i] = d; }} }}")
        finish = dk._C_INT_FINISH if name.startswith(("int", "uint")) else "d = (T)((double)d / n)"
        src.append(f"void finish_{name}(T_{name}* dd, long long count, long long n) {{ typedef T_{name} T; "
                   f"for (long long i = 0; i < count; i++) {{ T d = dd[i]; {{ {finish}; }} dd[i] = d; }} }}")
    (tmp_path / "k.c").write_text("\n".join(src))
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", "-o", str(tmp_path / "k.so"), str(tmp_path / "k.c"), "-lm"],
                   check=True, capture_output=True, timeout=120)
    import ctypes
    return ctypes.CDLL(str(tmp_path / "k.so"))


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to check the CuPy kernels' C on the host")
def test_cupy_fallback_kernels_bitwise_equal_to_cpu(tmp_path):
    import ctypes

    from allreduce import kernels
    from allreduce.kernels import cupy_fallback as dk
    from allreduce.ops import SUPPORTED_DTYPES, Op
    lib = _cupy_bodies_as_host_library(tmp_path)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)                       # noqa: E731
    rng = np.random.default_rng(3)
    for dtype in SUPPORTED_DTYPES:
        if dtype.kind == "b":
            a, b = (rng.integers(0, 2, 999).astype(bool) for _ in range(2))
        elif dtype.kind in "iu":
            a, b = (rng.integers(np.iinfo(dtype).min, int(np.iinfo(dtype).max) + 1, 999).astype(dtype)
                    for _ in range(2))
        else:
            with np.errstate(over="ignore"):                                 # huge -> inf on purpose
                a, b = [(rng.standard_normal(999) * 10.0 ** rng.integers(-6, 6, 999)).astype(dtype) for _ in range(2)]
            a[:5] = np.array([np.nan, np.inf, -0.0, 6e4, -np.inf]).astype(dtype)
        fmt = dk.half_format(dtype)
        for op in Op:
            if dtype.kind == "b" and op == Op.AVERAGE:                          # refused before any kernel
                continue
            for nranks in (1, 3):
                want, got = a.copy(), a.copy()
                kernels.reduce_finish_into(want, b, op, nranks)
                code = dk._AVG if op == Op.AVERAGE and nranks > 1 else (dk._SUM if op == Op.AVERAGE else int(op))
                n = ctypes.c_longlong(nranks)
                if fmt is not None:
                    lib.half_reduce(ptr(got), ptr(b), ctypes.c_longlong(got.size), n, code, ptr(fmt.table),
                                    *[ctypes.c_int(v) for v in dk._fmt_args(fmt)[:2]],
                                    ctypes.c_double(fmt.overflow), ctypes.c_int(fmt.nan_bits))
                else:
                    getattr(lib, f"native_{dtype.name}_{code}")(ptr(got), ptr(b), ctypes.c_longlong(got.size), n)
                assert got.tobytes() == want.tobytes(), f"{dtype} {op!r} nranks={nranks}"
        if dtype.kind == "b":
            continue
        want, got = a.copy(), a.copy()
        kernels.finish(want, Op.AVERAGE, 7)
        if fmt is not None:
            lib.half_finish(ptr(got), ctypes.c_longlong(got.size), ctypes.c_longlong(7), ptr(fmt.table),
                            *[ctypes.c_int(v) for v in dk._fmt_args(fmt)[:2]],
                            ctypes.c_double(fmt.overflow), ctypes.c_int(fmt.nan_bits))
        else:
            getattr(lib, f"finish_{dtype.name}")(ptr(got), ctypes.c_longlong(got.size), ctypes.c_longlong(7))
        assert got.tobytes() == want.tobytes(), f"finish {dtype}"


_PTX_CHECK = r"""
import numba.cuda.dispatcher as dispatcher
from numba import cuda, types
class _H200:            # device functions ask the current GPU for its compute capability
    compute_capability = (9, 0)
dispatcher.get_current_device = lambda: _H200()
from allreduce.kernels import cuda_numba as dk
A = lambda t: types.Array(t, 1, "C")
ptx = lambda kernel, *sig: cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
i64, f64, u16, table = types.int64, types.float64, A(types.uint16), A(types.float32)
count = 0
for t in (types.float32, types.int8):   # a float and an int (all eight: 46 kernels, about 25 s)
    for k in (dk._sum, dk._prod, dk._min, dk._max):
        ptx(k, A(t), A(t)); count += 1
    floating = t in (types.float32, types.float64)
    ptx(dk._sum_avg if floating else dk._int_sum_avg, A(t), A(t), i64)
    ptx(dk._avg if floating else dk._int_avg, A(t), i64); count += 2
ptx(dk._reduce_half, u16, u16, i64, i64, table, i64, i64, f64, i64)
ptx(dk._avg_half, u16, i64, table, i64, i64, f64, i64); count += 2
for t in (types.float32, types.float64):
    ptx(dk._encode_scaled, u16, A(t), f64, i64, i64, f64, i64)
    ptx(dk._decode_scaled, A(t), u16, f64, table); count += 2
print("compiled", count)
"""


def _nvvm_available() -> bool:
    probe = "from numba.cuda.cudadrv import nvvm; print(nvvm.is_available())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not _nvvm_available(), reason="needs libNVVM to compile for a real GPU without one "
                    "(pip install nvidia-cuda-nvcc-cu12, CUDA_HOME=<site-packages>/nvidia/cuda_nvcc)")
def test_kernels_compile_to_ptx_for_a_real_gpu():
    """Every kernel through numba's real CUDA compiler (sm_90), not the simulator: catches what
    the simulator accepts but a GPU cannot compile (``np.rint`` in a device function, say)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _PTX_CHECK], capture_output=True, text=True, timeout=600,
                         env=env, cwd=ROOT)
    assert out.returncode == 0 and "compiled 18" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
