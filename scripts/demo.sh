#!/usr/bin/env bash
# Set everything up on a fresh machine, then run the short demo on 4 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=2
exec .venv/bin/allreduce-run -np 4 .venv/bin/python examples/demo.py "$@"
