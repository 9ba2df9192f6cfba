#!/usr/bin/env bash
# GPU check of needle's CUDA backend: build, CUDA tests, benchmarks; logs into OUTDIR.
#
# Usage: bench/gpu_check.sh OUTDIR
# Needs (and installs nothing, no network): Python with NumPy, CuPy, PyTorch (CUDA), pybind11,
# CMake, pytest; an NVIDIA GPU. Every step has its own timeout, cut further so that the whole
# run ends within DEADLINE seconds (default 480: well inside 10 minutes); a failing step is
# recorded and the next one still runs. BENCH_GPU_ARGS (e.g. "--quick") go to bench_gpu.py.
# Exit status: 0 when every step passed, else the number of failed steps.
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
# A plain "python" may be missing where "python3" is the interpreter that holds CuPy and PyTorch.
PY=${PYTHON:-$(command -v python3 || command -v python)}
# needle is built in place, not installed: subprocesses the tests start import it from here
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NEEDLE_BUILD_JOBS=${NEEDLE_BUILD_JOBS:-8}
unset CUPY_TF32  # float32 comparisons are without TF32 on both sides
DEADLINE=${DEADLINE:-480}
failed=0
summary="$OUT/summary.txt"
: > "$summary"

step() {  # step NAME SECONDS COMMAND... : run with a timeout, tee the log, record the status
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "$name: SKIPPED (deadline of ${DEADLINE} s reached)" | tee -a "$summary"
    failed=$((failed + 1))
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "=== $name: $*" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local line="$name: rc=$rc ($((SECONDS - start)) s)"
  [ "$rc" -eq 124 ] && line="$line TIMEOUT after ${limit} s"
  echo "$line" | tee -a "$summary"
  [ "$rc" -ne 0 ] && failed=$((failed + 1))
  return 0
}

step env 30 bash -c "nvidia-smi; $PY -c 'import sys, numpy, cupy, torch; \
print(sys.version); print(\"numpy\", numpy.__version__, \"cupy\", cupy.__version__, \
\"torch\", torch.__version__, \"torch.cuda\", torch.cuda.is_available()); \
cupy.show_config()'"
# The C++ CPU backend (the CPU reference path of the device-parametrised tests).
step build 180 "$PY" setup.py build_ext --inplace
step cuda_available 60 "$PY" -c "
import needle.backend_ndarray as nd
from needle.backend_ndarray import devices, ndarray_backend_cuda as B
print('cuda enabled:', nd.cuda().enabled(), devices._LOAD_ERRORS)
assert nd.cuda().enabled(), 'cuda() is disabled'
a = B.Array(4); B.fill(a, 1.0)  # compiles strided.cu once (NVRTC), cached afterwards
print(B.to_numpy(a, (4,), (1,), 0))"
# The backend's own kernel tests on the device (every entry point x dtype x view).
step test_cuda_backend 120 "$PY" -m pytest python_tests/backend_ndarray/test_cuda_backend.py \
  python_tests/backend_ndarray/test_cuda_launch.py -q -rs --tb=short -p no:cacheprovider
# Every device-parametrised test of the suite, cuda case only.
# Such a machine may lack the suite's other test dependencies (hypothesis, pytest-timeout,
# scikit-learn, mpi4py): modules that cannot be imported are reported, not fatal.
timeout_opt=()
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout=120)
step test_suite_cuda 180 "$PY" -m pytest python_tests -q -rs -k cuda -m "not mpi" \
  --tb=short --continue-on-collection-errors -p no:cacheprovider \
  ${timeout_opt[@]+"${timeout_opt[@]}"}
step bench_gpu 180 "$PY" bench/bench_gpu.py ${BENCH_GPU_ARGS:-}
# Where a cuda() training step spends its time: launches per kernel family, cProfile, the
# host cost of one launch, elementwise kernel shapes (the input to the next round of work).
step gpu_profile 120 "$PY" bench/gpu_profile.py

echo "=== $failed step(s) failed; logs in $OUT" | tee -a "$summary"
exit "$failed"
