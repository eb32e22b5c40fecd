#!/usr/bin/env bash
# GPU check: the device paths of allreduce on a machine with a CUDA GPU, in under 5 minutes.
#
#   bash scripts/gpu_check.sh            # from the repository root (or anywhere)
#   NO_INSTALL=1 MAX_BYTES=$((16<<20)) bash scripts/gpu_check.sh    # offline, smaller sweep
#
# 1. environment: GPU, numba's CUDA compiler (libNVVM), CuPy (installed if missing), CUDA-aware MPI;
# 2. pytest tests/test_cuda_gpu.py (GPU kernels bitwise vs CPU, CuPy staging on threads);
# 3. for 2 and 4 ranks on ONE GPU, for the staging and the CUDA IPC paths:
#    the correctness matrix (every dtype x op x size, ring and rhd) and a busbw sweep;
# 4. a summary table. Everything skipped is listed with its reason. Exit 1 if any check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python}
MAX_BYTES=${MAX_BYTES:-$((64 << 20))}
LOG=$(mktemp -d /tmp/gpu_check.XXXXXX)
SKIPPED=()
FAILED=()
ROWS=()
START=$SECONDS
say() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - START)); }

say "environment"
if ! nvidia-smi -L; then
    echo "no GPU visible (nvidia-smi failed): nothing to check"; exit 2
fi
install() {  # install() PACKAGE: pip install, unless NO_INSTALL=1; a failure is a skip, not an error
    if [[ -n "${NO_INSTALL:-}" ]]; then SKIPPED+=("NO_INSTALL=1: did not install $1"); return 0; fi
    timeout 180 "$PY" -m pip install -q "$1" || SKIPPED+=("pip install $1 failed (offline?)")
}
if ! "$PY" -c "from numba.cuda.cudadrv import nvvm; assert nvvm.is_available()" 2>/dev/null; then
    # numba compiles kernels with libNVVM: from a CUDA toolkit, or from the nvidia-cuda-nvcc wheel.
    install nvidia-cuda-nvcc-cu12
    NVCC_DIR=$("$PY" -c "import nvidia.cuda_nvcc as m; print(list(m.__path__)[0])" 2>/dev/null || true)
    if [[ -n "$NVCC_DIR" ]]; then export CUDA_HOME="$NVCC_DIR"; fi
fi
if ! "$PY" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" 2>/dev/null; then
    install cupy-cuda12x
fi
"$PY" - <<'EOF' | tee "$LOG/env.txt"
from allreduce import device
from allreduce.kernels import cuda as dk
print("kernel backend :", dk.backend())
print("GPUs           :", device.num_devices())
print("CuPy           :", "yes" if dk._cupy() is not None else "no")
print("CUDA-aware MPI :", device.cuda_aware_mpi())
EOF
BACKEND=$(awk -F': ' '/kernel backend/ {print $2}' "$LOG/env.txt")
if [[ "$BACKEND" == "None" ]]; then
    echo "neither numba (driver + libNVVM) nor CuPy can run kernels here"; exit 2
fi
if [[ "$BACKEND" == "cupy" ]]; then
    SKIPPED+=("numba cannot compile (no libNVVM): kernels ran as CuPy ElementwiseKernels; the IPC path needs numba")
fi
grep -q "CUDA-aware MPI : True" "$LOG/env.txt" || SKIPPED+=("MPI is not CUDA-aware: device buffers are staged through pinned host memory (the staging path)")

say "pytest tests/test_cuda_gpu.py"
if timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_gpu.py -k "not mpi_matrix" 2>&1 | tee "$LOG/pytest.txt"; then
    ROWS+=("pytest|-|-|$(tail -1 "$LOG/pytest.txt")|")
else
    FAILED+=("pytest tests/test_cuda_gpu.py"); ROWS+=("pytest|-|-|FAILED: $(tail -1 "$LOG/pytest.txt")|")
fi

for NP in 2 4; do
    for PATH_ in staging ipc; do
        say "mpirun -np $NP, path $PATH_: correctness matrix and busbw sweep"
        OUT="$LOG/$PATH_-$NP.txt"
        rc=0
        EXPORTS=(-x PYTHONPATH -x PYTHONUNBUFFERED)
        for v in CUDA_HOME NUMBA_ENABLE_CUDASIM ALLREDUCE_DEVICE; do if [[ -n "${!v:-}" ]]; then EXPORTS+=(-x "$v"); fi; done
        timeout 100 mpirun --oversubscribe --allow-run-as-root --bind-to none -np "$NP" "${EXPORTS[@]}" \
            "$PY" tests/mpi/cuda_allreduce.py --path "$PATH_" --check --bench --max-bytes "$MAX_BYTES" \
            >"$OUT" 2>&1 || rc=$?
        grep -E '^(#| +[0-9]|FAIL)' "$OUT" || true
        check=$(sed -n 's/^RESULT check .*cases=\([0-9]*\) failures=\([0-9]*\).*/\2 of \1 failed/p' "$OUT")
        peak=$(sed -n 's/^RESULT bench .*peak_busbw=\([0-9.]*\) at_bytes=\([0-9]*\).*/\1 GB\/s at \2 B/p' "$OUT")
        note=$(sed -n 's/^RESULT fallback [^:]*: //p' "$OUT")
        case $rc in
            0) ;;
            3) SKIPPED+=("ipc, np=$NP: fell back to staging: $note") ;;
            124) FAILED+=("$PATH_ np=$NP: timed out after 100 s"); note="timeout"; tail -20 "$OUT" ;;
            *) FAILED+=("$PATH_ np=$NP: exit $rc"); tail -20 "$OUT" ;;
        esac
        ROWS+=("$PATH_|$NP|${check:-not run}|${peak:-not run}|${note:-}")
    done
done

say "summary (logs in $LOG)"
printf '%-9s %-3s %-22s %-30s %s\n' "path" "np" "correctness" "peak busbw (float32 Sum)" "note"
printf '%-9s %-3s %-22s %-30s %s\n' "---------" "---" "----------------------" "------------------------------" "----"
for row in "${ROWS[@]}"; do
    IFS='|' read -r a b c d e <<<"$row"
    printf '%-9s %-3s %-22s %-30s %s\n' "$a" "$b" "$c" "$d" "$e"
done
echo
echo "skipped (${#SKIPPED[@]}):"
for s in "${SKIPPED[@]+"${SKIPPED[@]}"}"; do echo "  - $s"; done
echo "failed (${#FAILED[@]}):"
for f in "${FAILED[@]+"${FAILED[@]}"}"; do echo "  - $f"; done
echo "total $((SECONDS - START)) s"
[[ ${#FAILED[@]} -eq 0 ]]
