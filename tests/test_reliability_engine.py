"""Reliability of the engine: bad input on p thread ranks, broken ranks under allreduce-run, fuzz.

Bad input: each case asserts what every rank saw, and proves the engine
still works by a correct allreduce afterwards. Complements
tests/test_engine_errors.py (shape/dtype/op/compression mismatch of one
name, stall warning and StallError) and tests/test_engine_compression.py
(fp16 overflow on one rank). Broken ranks: tests/mpi/reliability_fault.py
under ``python -m allreduce.run``. Fuzz: hypothesis-generated settings and
metadata. RELIABILITY.md lists every case and the command for each.
"""
import gc
import logging
import os
import re
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from allreduce.config import Config
from allreduce.engine import Compression, Compressor
from allreduce.errors import (AllreduceError, CompressionError, InvalidArgumentError, MismatchError, ShutdownError,
                              StallError)
from allreduce.kernels.reference import allreduce_reference
from allreduce.ops import Op

from .engine_util import engines, submit_all, wait_all
from .harness import MPI_SCRIPTS, kill_tagged, mpi_env, mpirun


def _still_usable(engs, step=0):
    """A correct Sum on every rank: the proof that a failure left the engine working."""
    p = len(engs)
    inputs = {f"after{i}": [np.full(5 + i, r + step, np.float64) for r in range(p)] for i in range(3)}
    for name, res in wait_all(submit_all(engs, inputs, np.random.default_rng(step), op=Op.SUM)).items():
        assert all(x.tolist() == [sum(range(p)) + p * step] * x.size for x in res), name


# -- mismatches of one name -------------------------------------------------------------------
def test_every_rank_different_shape_and_dtype_names_every_rank():
    p = 3
    with engines(p) as engs:
        xs = [np.ones(4, np.float32), np.ones(5, np.float32), np.ones(4, np.int32)]
        handles = [e.submit(xs[r], name="w", op=Op.SUM) for r, e in enumerate(engs)]
        messages = []
        for h in handles:
            with pytest.raises(MismatchError) as info:
                h.wait(20)
            messages.append(str(info.value))
        assert len(set(messages)) == 1
        assert "shape differs across ranks (rank 0: (4,), rank 1: (5,), rank 2: (4,))" in messages[0]
        assert "dtype differs across ranks (rank 0: float32, rank 1: float32, rank 2: int32)" in messages[0]
        _still_usable(engs)


# -- the same name twice in flight ----------------------------------------------------------
@pytest.mark.parametrize("where", ["every-rank", "one-rank"])
def test_duplicate_name_in_flight_is_refused_at_submit(where):
    p = 3
    with engines(p) as engs:
        first = [e.submit(np.full(3, r, np.float32), name="dup", op=Op.SUM) for r, e in enumerate(engs)]
        offenders = range(p) if where == "every-rank" else [1]
        for r in offenders:
            with pytest.raises(InvalidArgumentError, match=f"rank {r}: a tensor named 'dup' is already in flight"):
                engs[r].submit(np.zeros(3, np.float32), name="dup", op=Op.SUM)
        assert all(h.wait(20).tolist() == [3.0] * 3 for h in first)     # the first submission is intact
        again = [e.submit(np.ones(3, np.float32), name="dup", op=Op.SUM) for e in engs]   # free again
        assert all(h.wait(20).tolist() == [3.0] * 3 for h in again)
        _still_usable(engs)


# -- the caller's array while in flight -----------------------------------------------------
def test_array_deleted_while_in_flight_is_kept_alive_and_reduced():
    with engines(2) as engs:
        x = np.full(1000, 2.0)
        alive = weakref.ref(x)
        h0 = engs[0].submit(x, name="freed", op=Op.SUM)
        del x
        gc.collect()
        assert alive() is not None, "the engine must hold the array until it is packed"
        h1 = engs[1].submit(np.full(1000, 1.0), name="freed", op=Op.SUM)
        assert h0.wait(20).tolist() == [3.0] * 1000 and h1.wait(20).tolist() == [3.0] * 1000
        _still_usable(engs)


def test_array_resized_while_in_flight_is_refused_by_numpy():
    with engines(2) as engs:
        x = np.full(8, 2.0)
        h0 = engs[0].submit(x, name="resized", op=Op.SUM)
        with pytest.raises(ValueError, match="cannot resize an array that references or is referenced"):
            x.resize(100)                      # the engine's reference makes numpy refuse
        h1 = engs[1].submit(np.full(8, 1.0), name="resized", op=Op.SUM)
        assert h0.wait(20).tolist() == [3.0] * 8 and h1.wait(20).tolist() == [3.0] * 8
        _still_usable(engs)


def test_array_written_while_in_flight_raises_instead_of_changing_the_result():
    with engines(2) as engs:
        x = np.full(4, 1.0)
        h0 = engs[0].submit(x, name="written", op=Op.SUM)
        with pytest.raises(ValueError, match="read-only"):
            x[:] = 5.0                         # the engine has not read x yet: the write is refused
        h1 = engs[1].submit(np.full(4, 1.0), name="written", op=Op.SUM)
        results = [h0.wait(20), h1.wait(20)]
        assert results[0].tobytes() == results[1].tobytes()
        assert results[0].tolist() == [2.0] * 4
        assert x.flags.writeable               # given back once the handle is done
        x[:] = 5.0
        _still_usable(engs)


# -- layouts and flags --------------------------------------------------------------------------
def _layouts(r):
    base = np.arange(24, dtype=np.float32).reshape(4, 6) * (r + 1)
    ro = base.copy()
    ro.setflags(write=False)
    ro_strided = base.copy()[::2, 1::2]
    ro_strided.setflags(write=False)
    return {"read-only": ro, "read-only-strided": ro_strided, "fortran": np.asfortranarray(base),
            "negative-stride": base[::-1, ::-1], "transposed": base.T, "zero-stride": np.broadcast_to(
                np.float32(r + 1), (3, 5)), "0-d": np.float64(r + 1), "empty": np.zeros((0, 3), np.float32),
            "list": [r + 1, 2 * (r + 1)]}


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_non_contiguous_and_read_only_inputs(compression):
    p = 3
    inputs = {name: [_layouts(r)[name] for r in range(p)] for name in _layouts(0)}
    before = {name: [np.array(x, copy=True) for x in xs] for name, xs in inputs.items()}
    with engines(p) as engs:
        results = wait_all(submit_all(engs, inputs, np.random.default_rng(1), op=Op.SUM,
                                      compression=getattr(Compression, compression)))
        _still_usable(engs)
    for name, xs in inputs.items():
        want = sum(np.asarray(x, np.float64) for x in xs)
        for res in results[name]:
            assert res.shape == np.shape(xs[0]) and res.tobytes() == results[name][0].tobytes(), name
            np.testing.assert_allclose(res, want, rtol=2e-3 if compression == "fp16" else 0, err_msg=name)
        for x, old in zip(xs, before[name]):
            assert np.array_equal(np.asarray(x), old), f"{name}: the input was modified"
    assert not inputs["read-only"][0].flags.writeable and not inputs["read-only-strided"][0].flags.writeable


# -- arguments refused at submit ------------------------------------------------------------------
BAD_SUBMITS = [
    (dict(op=7), TypeError, "op must be one of"),
    (dict(op="sum"), TypeError, "op must be one of"),
    (dict(op=None), TypeError, "op must be one of"),
    (dict(compression=object()), TypeError, "has no 'compress'"),
    (dict(name=""), InvalidArgumentError, "name must be a non-empty string"),
    (dict(name=3), InvalidArgumentError, "name must be a non-empty string"),
    (dict(x=np.ones(2, np.complex64)), TypeError, "unsupported dtype complex64"),
    (dict(x=np.ones(2, bool), op=Op.AVERAGE), TypeError, "Average of bool is undefined"),
    (dict(x=np.array(["ab"])), TypeError, "unsupported dtype <U2"),
    (dict(x=np.array([object()])), TypeError, "unsupported dtype object"),
    (dict(x=np.ones(2, np.longdouble)), TypeError, f"unsupported dtype {np.dtype(np.longdouble)}"),
    (dict(x=np.ones(2, np.uint32)), TypeError, "unsupported dtype uint32"),
]


@pytest.mark.parametrize("bad,error,fragment", BAD_SUBMITS, ids=[re.sub(r" at 0x[0-9a-f]+", "", str(b)) for b, _, _ in BAD_SUBMITS])
def test_bad_argument_raises_at_submit_on_every_rank(bad, error, fragment):
    with engines(3) as engs:
        for e in engs:
            kwargs = {"name": "bad", **bad}
            x = kwargs.pop("x", np.ones(2, np.float32))
            with pytest.raises(error, match=fragment.replace("(", r"\(")):
                e.submit(x, **kwargs)
        _still_usable(engs)       # nothing was queued: no rank waits for 'bad'


# -- compression overflow ----------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["fp16", "fp16+ef"])
def test_fp16_overflow_on_every_rank_fails_that_tensor_everywhere(compression):
    p = 3
    comp = Compression.fp16 if compression == "fp16" else Compression.fp16.with_error_feedback()
    with engines(p) as engs:
        inputs = {"huge": [np.array([1.0, 3e5 * (r + 1)], np.float32) for r in range(p)],
                  "fine": [np.full(4, 0.5, np.float32)] * p}
        handles = submit_all(engs, inputs, np.random.default_rng(2), compression=comp)
        messages = []
        for h in handles["huge"]:
            with pytest.raises(CompressionError) as info:
                h.wait(20)
            messages.append(str(info.value))
        assert len(set(messages)) == 1 and "'huge'" in messages[0] and "rank(s) 0, 1, 2 " in messages[0]
        assert all(h.wait(20).tolist() == [0.5] * 4 for h in handles["fine"])
        # The same name with sane values: correct, and no residual left from the failed step.
        ok = wait_all(submit_all(engs, {"huge": [np.full(2, 3.0, np.float32)] * p}, compression=comp))
        assert all(r.tolist() == [3.0, 3.0] for r in ok["huge"])
        _still_usable(engs)


# -- custom compressors that misbehave ----------------------------------------------------------
class _Misbehaving(Compressor):
    """compress/decompress that fail in a chosen way (the same way on every rank)."""

    def __init__(self, kind: str):
        self.kind, self.name = kind, f"misbehaving-{kind}"

    def compress(self, x):
        if self.kind == "compress-raises":
            raise RuntimeError("compress failed on purpose")
        if self.kind == "complex-payload":
            return x.astype(np.complex64), None
        if self.kind == "none-payload":
            return None, None
        return x, None

    def decompress(self, payload, ctx):
        if self.kind == "decompress-raises":
            raise RuntimeError("decompress failed on purpose")
        return payload


def test_compressor_that_raises_fails_that_tensor_on_every_rank():
    with engines(3) as engs:
        handles = [e.submit(np.ones(3, np.float32), name="c", compression=_Misbehaving("compress-raises"))
                   for e in engs]
        for h in handles:
            with pytest.raises(RuntimeError, match="compress failed on purpose"):
                h.wait(20)
        _still_usable(engs)


@pytest.mark.parametrize("kind", ["complex-payload", "none-payload", "decompress-raises"])
def test_compressor_with_bad_payload_fails_that_tensor_not_the_engine(kind):
    with engines(2) as engs:
        handles = [e.submit(np.ones(3, np.float32), name="c", compression=_Misbehaving(kind)) for e in engs]
        for h in handles:
            with pytest.raises(Exception) as info:
                h.wait(5)
            assert not isinstance(info.value, TimeoutError), "the handle was orphaned: wait() would hang"
        _still_usable(engs)


# -- stalls: the late rank is told too ---------------------------------------------------------------
def test_late_submission_after_a_stall_error_fails_on_the_late_rank_too(caplog):
    p = 3
    caplog.set_level(logging.WARNING, logger="allreduce.engine")
    with engines(p, stall_check_time=0.1, stall_shutdown_time=0.4) as engs:
        early = [engs[r].submit(np.ones(3), name="lonely") for r in (0, 2)]
        for h in early:
            with pytest.raises(StallError, match=r"never by rank\(s\) 1\."):
                h.wait(20)
        late = engs[1].submit(np.ones(3), name="lonely")          # rank 1 arrives after the cutoff
        with pytest.raises(StallError, match=r"submitted by rank\(s\) 1, never by rank\(s\) 0, 2\."):
            late.wait(20)
        again = [e.submit(np.ones(3), name="lonely", op=Op.SUM) for e in engs]   # all ranks: fine again
        assert all(h.wait(20).tolist() == [3.0] * 3 for h in again)
        _still_usable(engs)
    warnings = [r.getMessage() for r in caplog.records]
    assert any("'lonely'" in w and "missing on rank(s) 1." in w for w in warnings)
    assert any("'lonely'" in w and "missing on rank(s) 0, 2." in w for w in warnings)


# -- shutdown ----------------------------------------------------------------------------------------
def test_submit_after_shutdown_raises_on_every_rank_and_pending_handles_fail():
    p = 3
    with engines(p) as engs:
        _still_usable(engs)
        pending = engs[0].submit(np.ones(2), name="only-rank-0")
        engs[1].shutdown(timeout=20)                  # one rank's shutdown stops every rank
        with pytest.raises(ShutdownError):
            pending.wait(20)
        for e in engs:
            e.shutdown(timeout=20)
            assert not e.alive
            with pytest.raises(ShutdownError, match=f"rank {e.rank}: the allreduce engine is shut down"):
                e.submit(np.ones(2), name="late")


def test_a_submit_to_an_engine_a_peers_death_stopped_is_known_as_that_death():
    # elastic.run tells a death from other errors by the type (liveness) or, through TensorFlow,
    # by the text: a later submit's ShutdownError carries both
    from allreduce.errors import PeerLostError
    from allreduce.transport.liveness import is_peer_failure
    with engines(2) as engs:
        engs[0]._fail_all(PeerLostError("rank 0: rank(s) 1 died while this rank waited for a peer"))
        with pytest.raises(ShutdownError, match="rank 0: the allreduce engine is shut down "
                                                r"\(PeerLostError: rank 0: rank\(s\) 1 died") as info:
            engs[0].submit(np.ones(2), name="late")
        assert is_peer_failure(info.value) and not is_peer_failure(ShutdownError("shut down"))


# -- a rank dies or raises under allreduce-run (real processes) -------------------------------------
BOUND = 30.0   # seconds from the fault until every survivor is gone and the launcher has returned


def _launch_broken(mode: str, np_: int, timeout: float) -> tuple[int, str, float]:
    """Run reliability_fault.py MODE under ``python -m allreduce.run``; return (exit code, output,
    seconds from the fault to the launcher's exit)."""
    cmd = [sys.executable, "-m", "allreduce.run", "-np", str(np_), sys.executable,
           str(MPI_SCRIPTS / "reliability_fault.py"), mode]
    env = mpi_env()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_tagged(env["ALLREDUCE_TEST_TAG"])
        out, _ = proc.communicate()
        pytest.fail(f"TIMEOUT: {mode} did not end within {timeout:g} s\n{out[-3000:]}")
    ended = time.time()
    broke = re.search(r"rank 1 breaks at (\d+\.\d+)", out)
    assert broke, f"rank 1 never reached its fault\n{out[-3000:]}"
    return proc.returncode, out, ended - float(broke.group(1))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["engine-exit", "engine-kill", "engine-raise"])
def test_rank_dies_or_raises_during_engine_traffic(mode):
    code, out, after = _launch_broken(mode, 3, timeout=150)
    assert code != 0, out[-3000:]
    assert "UNREACHABLE" not in out, "a survivor carried on"
    assert after < BOUND, f"survivors took {after:.1f} s to go after rank 1 broke"
    assert "allreduce-run: the job failed: rank 1 failed first" in out, out[-3000:]
    if mode == "engine-raise":
        assert "allreduce: rank 1 of 3 failed with ValueError: boom in training code" in out, out[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fit-kill", "fit-raise"])
def test_rank_dies_or_raises_inside_keras_fit(mode):
    code, out, after = _launch_broken(mode, 2, timeout=400)     # TensorFlow start-up dominates
    assert code != 0, out[-3000:]
    assert "UNREACHABLE" not in out and out.count("fitting") == 2, out[-3000:]
    assert after < BOUND, f"the survivor took {after:.1f} s to go after rank 1 broke"
    assert "allreduce-run: the job failed: rank 1 failed first" in out, out[-3000:]
    if mode == "fit-raise":
        assert "allreduce: rank 1 of 2 failed with ValueError: boom in training code" in out, out[-3000:]


@pytest.mark.mpi
def test_after_shutdown_calls_raise_not_initialized_and_init_again_works():
    out = mpirun(2, "reliability_api.py", timeout=150).stdout
    assert out.count("OK reliability_api") == 2, out


# -- fuzz: generated metadata and settings reach the engine ------------------------------------------
_GOOD_DTYPES = [np.dtype(d) for d in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8")]
_DTYPES = st.sampled_from(_GOOD_DTYPES + [np.dtype(d) for d in ("complex64", "bool", "uint16", "U2", "O")])
_OPS = st.one_of(st.sampled_from(list(Op)), st.integers(-2, 7), st.sampled_from(["sum", None, 1.5]))
_COMPRESSIONS = st.sampled_from([None, Compression.none, Compression.fp16, Compression.bf16, "fp16", 3])
_TENSOR = st.fixed_dictionaries({
    "shape": st.lists(st.integers(0, 6), max_size=3).map(tuple), "dtype": _DTYPES, "op": _OPS,
    "compression": _COMPRESSIONS, "named": st.booleans(),
    "vary": st.sampled_from([None, None, None, "shape", "dtype", "op", "compression"])})
_SETTINGS = st.fixed_dictionaries({}, optional={
    "algorithm": st.sampled_from(["auto", "ring", "tree", "rhd", "rd", "shm", "mpi", "RING", "", "bogus"]),
    "cycle_time": st.sampled_from([0.2, 1.0, 0.0, -1.0, float("nan")]),
    "fusion_threshold": st.sampled_from([0, 64, 1 << 20, -5]),
    "cache_capacity": st.sampled_from([0, 1, 4, 1024, -1]),
    "segment_bytes": st.sampled_from([1, 7, 4096, 0, -8]),
    "stall_check_time": st.sampled_from([0.0, 60.0, -1.0]),
    "stall_shutdown_time": st.sampled_from([0.0, 60.0, -3.0]),
    "timeout": st.sampled_from([30.0, 0.0]),
    "bogus_setting": st.just(1)})
_ENV = st.dictionaries(st.sampled_from(["ALLREDUCE_CYCLE_TIME", "ALLREDUCE_FUSION_THRESHOLD", "ALLREDUCE_ALGORITHM",
                                        "ALLREDUCE_CACHE_CAPACITY", "ALLREDUCE_CHECK", "ALLREDUCE_SEGMENT_BYTES",
                                        "ALLREDUCE_STALL_SHUTDOWN_TIME"]),
                       st.sampled_from(["1", "0", "0.5", "4096", "-1", "abc", "", "yes", "1e3", "ring", "nan"]),
                       max_size=3)


def _vary(t: dict, rank: int) -> dict:
    """Rank 1's deliberate disagreement about one field (always a valid value)."""
    t = dict(t)
    valid = t["dtype"] in _GOOD_DTYPES and isinstance(t["op"], Op) and (t["compression"] is None or isinstance(
        t["compression"], Compressor))
    if rank != 1 or t["vary"] is None or not valid:     # refused on one rank only = a user-made stall
        return t
    if t["vary"] == "shape":
        t["shape"] = t["shape"] + (2,)
    elif t["vary"] == "dtype":
        t["dtype"] = np.dtype("int64") if t["dtype"] != np.dtype("int64") else np.dtype("float32")
    elif t["vary"] == "op":
        t["op"] = Op.MAX if t["op"] != Op.MAX else Op.MIN
    else:
        t["compression"] = Compression.bf16 if t["compression"] is not Compression.bf16 else Compression.none
    return t


def _make(t: dict, rank: int):
    n = int(np.prod(t["shape"], dtype=np.int64))
    try:
        return (np.arange(n) % 5 + rank).astype(t["dtype"]).reshape(t["shape"])
    except (TypeError, ValueError):
        return np.full(t["shape"], rank, dtype=t["dtype"])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settings_=_SETTINGS, env=_ENV, from_env=st.booleans(), tensors=st.lists(_TENSOR, min_size=1, max_size=4))
def test_fuzz_engine_metadata_and_settings(settings_, env, from_env, tensors):
    """A correct result, or a documented exception raised alike on every rank; never a crash or a hang."""
    p = 2
    try:
        config = Config.from_env(env, **settings_) if from_env else Config(**settings_)
    except (TypeError, ValueError) as exc:                 # a bad setting: refused by name, before any engine
        text = str(exc)     # names the variable (unparsable text) or the field (parsed, out of range)
        fields = [field for field, var in Config._ENV.items() if var in env]
        assert any(k in text for k in [*settings_, *env, *fields, "unknown setting"]), text
        return
    chosen = {f: getattr(config, f) for f in ("algorithm", "cycle_time", "fusion_threshold", "cache_capacity",
                                              "segment_bytes", "check")}
    if config.algorithm == "mpi":                          # these engines run on threads: refused up front
        with pytest.raises(ValueError, match="algorithm 'mpi' needs the MPI transport"):
            with engines(p, **chosen):
                pass
        return
    with engines(p, **chosen) as engs:
        outcomes = [[None] * len(tensors) for _ in range(p)]    # per rank: exception at submit, or handle
        for r, e in enumerate(engs):
            for i, t in enumerate(tensors):
                t = _vary(t, r)
                try:
                    outcomes[r][i] = e.submit(_make(t, r), name=f"t{i}" if t["named"] else None, op=t["op"],
                                              compression=t["compression"])
                except (TypeError, ValueError, AllreduceError) as exc:   # refused at submit
                    assert str(exc), "an error must say what is wrong"
                    outcomes[r][i] = exc
        for i, t in enumerate(tensors):
            got = []
            for r in range(p):
                o = outcomes[r][i]
                if isinstance(o, Exception):
                    got.append(o)
                    continue
                try:
                    got.append(o.wait(15))
                except TimeoutError:
                    raise
                except Exception as exc:  # noqa: BLE001 - classified below
                    got.append(exc)
            failed = [isinstance(g, Exception) for g in got]
            assert all(failed) or not any(failed), f"tensor {i} {t}: ranks disagree: {got}"
            if failed[0]:
                # The same error type everywhere, except a dead engine: its submits may raise
                # ShutdownError or fail the handle with AllreduceError.
                assert len({type(g) for g in got}) == 1 or all(isinstance(g, AllreduceError) for g in got), got
                assert all(isinstance(g, (TypeError, ValueError, AllreduceError)) and str(g) for g in got), got
                if t["vary"] is not None and isinstance(got[0], MismatchError):
                    assert f"{t['vary'] if t['vary'] != 'compression' else 'compression'} differs" in str(got[0])
                continue
            assert _vary(t, 1) == t, f"tensor {i}: rank 1 disagreed about {t['vary']} and still got a result"
            xs = [np.ascontiguousarray(_make(_vary(t, r), r)).reshape(-1) for r in range(p)]
            want = allreduce_reference(xs, Op(t["op"])).reshape(t["shape"])
            assert all(g.tobytes() == got[0].tobytes() for g in got), "ranks differ bitwise"
            assert got[0].shape == t["shape"] and got[0].dtype == t["dtype"]
            np.testing.assert_allclose(got[0].astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=1e-2)
