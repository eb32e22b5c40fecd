"""Device kernels and the staging path, on numba's CUDA simulator (no GPU needed).

The simulator must be switched on before numba is first imported, so this
file runs in its own process: ``tests/test_cuda.py::test_simulator_suite``
starts ``NUMBA_ENABLE_CUDASIM=1 pytest tests/test_cuda_sim.py``. In the
main test process (numba already imported without it) every test here is
skipped. Run it alone with::

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -q tests/test_cuda_sim.py

The simulator runs every CUDA thread as a Python thread: arrays stay small.
"""
import warnings

import numpy as np
import pytest
from numba.core import config as numba_config

if not numba_config.ENABLE_CUDASIM:
    pytest.skip("runs in its own process with NUMBA_ENABLE_CUDASIM=1 (see test_cuda.py::test_simulator_suite)",
                allow_module_level=True)

from numba import cuda  # noqa: E402

from allreduce import kernels  # noqa: E402
from allreduce.algorithms import ring  # noqa: E402
from allreduce.buffers import Workspace  # noqa: E402
from allreduce.comm import Communicator  # noqa: E402
from allreduce.config import Config  # noqa: E402
from allreduce.device import DeviceStaging, Typed  # noqa: E402
from allreduce.errors import InvalidArgumentError, MismatchError  # noqa: E402
from allreduce.kernels import cuda as dk, half  # noqa: E402
from allreduce.kernels.reference import reduce_pair  # noqa: E402
from allreduce.ops import SUPPORTED_DTYPES, Op, bfloat16  # noqa: E402
from allreduce.transport.threads import ThreadWorld, run_threads  # noqa: E402

from .harness import assert_allreduce_ok, make_inputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
HALVES = (np.dtype(np.float16), bfloat16)


def _storage(dtype) -> np.dtype:
    """How a dtype is held on the device: bfloat16 as uint16 (numba has no bfloat16)."""
    return np.dtype(np.uint16) if np.dtype(dtype) == bfloat16 else np.dtype(dtype)


def _operands(dtype, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random operands plus the awkward values: NaN, +-inf, -0, subnormals, int extremes."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        a, b = rng.integers(0, 2, n).astype(bool), rng.integers(0, 2, n).astype(bool)
        a[:4], b[:4] = [False, False, True, True], [False, True, False, True]   # every pair
        return a, b
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, int(info.max) + 1, n, dtype=np.int64).astype(dtype)
        b = rng.integers(info.min, int(info.max) + 1, n, dtype=np.int64).astype(dtype)
        a[:3] = [info.min, info.max, 0]
        return a, b
    a = (rng.standard_normal(n) * 8).astype(dtype)
    b = (rng.standard_normal(n) * 8).astype(dtype)
    tiny = float(np.finfo(dtype).smallest_subnormal)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, tiny, -tiny, float(np.finfo(dtype).max)])
    a[:8] = specials.astype(dtype)
    b[:8] = specials[::-1].astype(dtype)
    return a, b


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_kernels_bitwise_equal_to_cpu(dtype):
    a, b = _operands(dtype, 300, seed=len(str(dtype)))
    store = _storage(dtype)
    for op in Op:
        if np.dtype(dtype).kind == "b" and op == Op.AVERAGE:    # refused before any kernel runs
            continue
        for p in (1, 3):                       # reduce_into, then the fused-Average final step
            want = a.copy()
            dev, src = cuda.to_device(a.view(store)), cuda.to_device(b.view(store))
            if p == 1:
                kernels.reduce_into(want, b, op)
                dk.reduce_into(dev, src, op, dtype=dtype)
            else:
                kernels.reduce_finish_into(want, b, op, p)
                dk.reduce_finish_into(dev, src, op, p, dtype=dtype)
            got = dev.copy_to_host()
            assert got.tobytes() == want.view(store).tobytes(), f"{dtype} {op!r} p={p}"
            if p == 1 and dtype not in HALVES:  # and the numpy reference itself
                assert np.array_equal(got, reduce_pair(a, b, op), equal_nan=True), f"{dtype} {op!r}"
        dev = cuda.to_device(a.view(store))
        want = a.copy()
        kernels.finish(want, op, 5)
        dk.finish(dev, op, 5, dtype=dtype)
        assert dev.copy_to_host().tobytes() == want.view(store).tobytes(), f"finish {dtype} {op!r}"


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_half_average_on_bit_patterns_matches_cpu(dtype):
    # Every 16th bit pattern (all exponents, signs, NaN/inf/subnormal ranges), divided by 3 and 7.
    bits = np.arange(0, 65536, 16, dtype=np.uint16)
    for n in (3, 7):
        dev = cuda.to_device(bits)
        dk.finish(dev, Op.AVERAGE, n, dtype=dtype)
        want = bits.view(dtype).copy()
        kernels.finish(want, Op.AVERAGE, n)
        assert dev.copy_to_host().tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("source", [np.float32, np.float64], ids=["f32", "f64"])
def test_encode_decode_with_scale_match_cpu(dtype, source):
    fmt = dk.half_format(dtype)
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(500) * 1e3, [np.nan, np.inf, -np.inf, -0.0, 1e-9, 7e4, 3e38]])
    x = x.astype(source)
    for scale in (1.0, 0.25, 1 / 3):
        want_bits = np.empty(x.size, np.uint16)
        half.encode_into(want_bits, x, scale, *fmt.args[1:])
        dev_bits = cuda.device_array(x.size, np.uint16)
        dk.encode_into(dev_bits, cuda.to_device(x), scale, dtype)
        assert dev_bits.copy_to_host().tobytes() == want_bits.tobytes(), f"encode scale={scale}"
        want = np.empty(x.size, source)
        half.decode_into(want, want_bits, 1 / scale, fmt.table)
        dev = cuda.device_array(x.size, source)
        dk.decode_into(dev, dev_bits, 1 / scale, dtype)
        assert dev.copy_to_host().tobytes() == want.tobytes(), f"decode scale={scale}"


def test_encode_rejects_a_native_dtype():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        dk.encode_into(cuda.device_array(3, np.uint16), cuda.to_device(np.ones(3)), 1.0, np.float32)


# -- the staging path, through the communicator on the thread transport -----------------
def _device_allreduce(inputs, op, algorithm, *, inplace=False, segment_bytes=256, **config):
    """Each rank puts its input on the (simulated) device and allreduces it; returns host copies."""
    dtype = inputs[0].dtype

    def body(transport):
        comm = Communicator(transport, config=Config(segment_bytes=segment_bytes, **config))
        x = inputs[transport.rank]
        dev = cuda.to_device(x.view(_storage(dtype)))
        arg = Typed(dev, dtype) if dtype == bfloat16 else dev
        out = comm.allreduce_(arg, op, algorithm=algorithm) if inplace else comm.allreduce(arg, op, algorithm=algorithm)
        assert type(out) is type(arg), "the result must be of the input's type"
        if inplace:
            assert out is arg
        else:
            assert dev.copy_to_host().tobytes() == x.view(_storage(dtype)).tobytes(), "input was modified"
        raw = out.array if isinstance(out, Typed) else out
        assert raw.shape == x.shape
        return raw.copy_to_host().view(dtype)
    return run_threads(len(inputs), body, timeout=60)


@pytest.mark.parametrize("algorithm", ["ring", "rhd", "rd", "tree"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_staging_allreduce_matches_reference(algorithm, p):
    for count in (0, 1, 7, 1000):
        inputs = make_inputs(np.random.default_rng(count + p), p, count, np.float32, Op.SUM)
        assert_allreduce_ok(_device_allreduce(inputs, Op.SUM, algorithm), inputs, Op.SUM)


@pytest.mark.parametrize("algorithm", ["shm", "hierarchical", "auto"])
def test_staging_through_algorithms_that_bypass_point_to_point(algorithm):
    # shm and hierarchical reach for the transport's world: the staging waits for every copy first.
    inputs = make_inputs(np.random.default_rng(1), 3, 500, np.float32, Op.AVERAGE)
    assert_allreduce_ok(_device_allreduce(inputs, Op.AVERAGE, algorithm, fake_node_size=2), inputs, Op.AVERAGE)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_staging_every_dtype_bitwise_equal_to_host_path(dtype):
    p, op = 3, (Op.MAX if np.dtype(dtype).kind == "b" else Op.AVERAGE)   # bool: logical or
    inputs = make_inputs(np.random.default_rng(3), p, 50, dtype, op)
    got = _device_allreduce(inputs, op, "ring", inplace=True, segment_bytes=32)
    host = run_threads(p, lambda t: Communicator(t, config=Config(segment_bytes=32))
                       .allreduce(inputs[t.rank], op, algorithm="ring"))
    assert_allreduce_ok(got, inputs, op)
    assert got[0].tobytes() == host[0].tobytes()


def test_staging_shapes_and_ops():
    p = 4
    for op in Op:
        inputs = [x.reshape(6, 7) for x in make_inputs(np.random.default_rng(int(op)), p, 42, np.float64, op)]
        assert_allreduce_ok(_device_allreduce(inputs, op, "auto"), inputs, op)


def _staged_ring(p: int, count: int, segment_bytes: int):
    """Run ring directly on StagedTransport; return each rank's (result, staging log, segments)."""
    inputs = make_inputs(np.random.default_rng(7), p, count, np.float32, Op.SUM)

    def body(transport):
        dev = cuda.to_device(inputs[transport.rank])
        host = np.empty(count, np.float32)
        staging = DeviceStaging(dev, host, segment_bytes=segment_bytes, stream=cuda.stream())
        staging.download()
        ring.allreduce(staging.transport(transport), host, Op.SUM, workspace=Workspace(),
                       segment_bytes=segment_bytes)
        staging.upload()
        return dev.copy_to_host(), staging.log, staging.segments
    return inputs, run_threads(p, body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_staging_overlaps_copies_with_sends(p):
    inputs, results = _staged_ring(p, count=480, segment_bytes=64)      # 16 floats a segment
    assert_allreduce_ok([r for r, _, _ in results], inputs, Op.SUM)
    for rank, (_, log, segments) in enumerate(results):
        kinds = [e[0] for e in log]
        assert kinds.count("d2h") == kinds.count("h2d") == len(segments), f"rank {rank}: one copy per segment"
        assert kinds.index("h2d") > max(i for i, k in enumerate(kinds) if k in ("send", "recv"))
        ready: set[int] = set()
        for event in log:
            if event[0] == "ready":
                ready.add(event[1])
            elif event[0] in ("send", "recv"):                # synchronised before every transfer
                off, n = event[1], event[2]
                need = {k for k, (o, m) in enumerate(segments) if o < off + n and off < o + m}
                assert need <= ready, f"rank {rank}: {event[0]} of [{off}, {off + n}) before its D2H copy"
        first_send = kinds.index("send")
        assert kinds[:first_send].count("ready") < len(segments), \
            f"rank {rank}: the first send waited for every D2H copy: no overlap"


def test_staging_rejects_a_host_buffer_of_the_wrong_size():
    with pytest.raises(InvalidArgumentError, match="staging buffer"):
        DeviceStaging(cuda.to_device(np.ones(4, np.float32)), np.empty(3, np.float32), segment_bytes=8)


def test_ipc_falls_back_to_staging_under_the_simulator():
    inputs = make_inputs(np.random.default_rng(0), 3, 100, np.float32, Op.SUM)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _device_allreduce(inputs, Op.SUM, "ring", cuda_ipc=True)
    assert_allreduce_ok(got, inputs, Op.SUM)
    assert any("CUDA IPC allreduce unavailable (the CUDA simulator has no IPC)" in str(w.message) for w in caught)


def test_mismatched_counts_raise_on_every_rank():
    def body(transport):
        comm = Communicator(transport, config=Config())
        try:
            comm.allreduce(cuda.to_device(np.ones(3 + transport.rank, np.float32)), Op.SUM)
        except MismatchError as exc:
            return str(exc)
    messages = run_threads(2, body)
    assert all(m and "count differs" in m for m in messages)


def test_invalid_inputs_fail_before_any_message():
    comm = Communicator(ThreadWorld(1).transport(0))
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        comm.allreduce(cuda.to_device(np.ones((4, 4), np.float32)).T, Op.SUM)
    with pytest.raises(TypeError, match="unsupported dtype"):
        comm.allreduce(cuda.to_device(np.ones(4, np.complex64)), Op.SUM)
    with pytest.raises(InvalidArgumentError, match="cannot hold"):
        Typed(cuda.to_device(np.ones(4, np.float32)), bfloat16)
    with pytest.raises(ValueError, match="unknown algorithm"):
        comm.allreduce(cuda.to_device(np.ones(4, np.float32)), Op.SUM, algorithm="nope")
    assert comm.allreduce(cuda.to_device(np.full(4, 6, np.int32)), Op.AVERAGE).copy_to_host().tolist() == [6] * 4
