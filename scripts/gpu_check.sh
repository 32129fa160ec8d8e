#!/usr/bin/env bash
# The GPU check, one command (scripts/gpu_check.py says what it runs): on a machine with one CUDA GPU,
# torch and CuPy, from the repository root. It builds the C++ codec in place (the CPU side of the identity
# checks) and writes OUT/report.json and OUT/report.md (OUT: default build/gpu-check). Exit 0: all passed;
# 1: a check failed (the report says which); 2: no GPU, nothing run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-check}
PY=${HVD_TERNGRAD_PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); this check needs one." \
       "Nothing was run." >&2
  exit 2
fi
if ! ls hvd_terngrad/_terngrad_cpu*.so >/dev/null 2>&1; then
  echo "gpu_check: building the C++ codec (setup.py build_ext --inplace)"
  "$PY" setup.py -q build_ext --inplace >"${TMPDIR:-/tmp}/gpu_check_build.log" 2>&1 ||
    { echo "gpu_check: the C++ build failed; log: ${TMPDIR:-/tmp}/gpu_check_build.log" >&2; exit 1; }
fi
timeout 300 "$PY" -m scripts.gpu_check --out "$OUT"
