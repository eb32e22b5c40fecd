#!/usr/bin/env bash
# Create .venv (once) and install the project with every extra the demo and tests need.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,tf]"
# Root (CI, containers): Open MPI refuses to start without these.
echo "setup: $(.venv/bin/python --version), $(.venv/bin/mpirun --version | head -n1)"
