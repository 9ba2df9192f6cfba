#!/usr/bin/env bash
# GPU check of needle's CUDA backend: build, CUDA tests, device equality checks, benchmarks;
# logs and one summary table (OUTDIR/summary.md) in OUTDIR.
#
# Usage: bench/gpu_check.sh OUTDIR
# Needs (and installs nothing, no network): Python with NumPy, CuPy, PyTorch (CUDA), pybind11,
# CMake, pytest; an NVIDIA GPU. Each step has its own time budget (the budgets add up to at
# most DEADLINE, default 480 s: the whole run fits in 8 minutes); a step never runs past the
# deadline, and steps the deadline leaves no room for are SKIPPED. A failing step is recorded
# and the next one still runs. Steps whose tests are not in this checkout are ABSENT.
# Environment: PYTHON (default python3), DEADLINE, BENCH_GPU_ARGS (e.g. "--quick") for
# bench_gpu.py; DRY_RUN=1 lists the steps with their commands and budgets without running
# anything, each step taking its whole budget on a simulated clock (a check of the deadline
# arithmetic on any machine).
# Benches print "RESULT name value unit ratio against" lines; summary.md collects them.
# Exit status: 0 when every step passed (or is absent), else the number of failed steps.
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
DRY_RUN=${DRY_RUN:-0}
MIN_STEP=10  # a step with less time left than this is skipped
failed=0
simulated=0  # DRY_RUN: seconds the listed steps would have taken
rows="$OUT/.rows"
: > "$rows"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "?")

now() { echo $((SECONDS + simulated)); }

key_numbers() {  # the RESULT lines of a log, else pytest's tally, else its last line
  local log=$1 found
  found=$(awk '$1 == "RESULT" && NF >= 4 {
      line = $2 " " $3 " " $4
      if (NF >= 5 && $5 != "-") line = line " (" $5 "x" (NF >= 6 ? " " $6 : "") ")"
      out = out (out == "" ? "" : "<br>") line } END { print out }' "$log")
  [ -z "$found" ] && found=$(grep -E "^=*.*[0-9]+ (passed|failed|error)" "$log" | tail -1 \
    | tr -d '=' | sed 's/^ *//; s/ *$//')
  [ -z "$found" ] && found=$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-160)
  echo "${found//|/\\|}"
}

record() {  # record NAME STATUS SECONDS LIMIT NOTES: one table row, notes on one line
  local notes=${5//$'\n'/ }
  [ ${#notes} -gt 400 ] && notes="${notes:0:400}..."
  printf '| %s | %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" "$notes" >> "$rows"
  echo "$1: $2 ($3 s of $4 s) $notes"
}

step() {  # step NAME BUDGET COMMAND... : run with a time limit, log, record the status
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - $(now)))
  if [ "$left" -lt "$MIN_STEP" ]; then
    record "$name" SKIPPED 0 "$limit" "deadline of ${DEADLINE} s reached"
    failed=$((failed + 1))
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$OUT/$name.log"
  echo "=== $name (limit ${limit} s): $*" | tee "$log"
  if [ "$DRY_RUN" = 1 ]; then
    simulated=$((simulated + limit))
    local cmd="$*"
    record "$name" DRY "$limit" "$limit" "${cmd//|/\\|}"
    return 0
  fi
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]} status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMEOUT"
  elif [ "$rc" -eq 5 ] && grep -q "no tests ran\|deselected" "$log"; then
    status="ABSENT"  # pytest selected nothing: the feature's tests are not in this checkout
    rc=0
  elif [ "$rc" -ne 0 ]; then
    status="FAILED (rc=$rc)"
  fi
  record "$name" "$status" $((SECONDS - start)) "$limit" "$(key_numbers "$log")"
  [ "$rc" -ne 0 ] && failed=$((failed + 1))
  return 0
}

pytest_opts=(-q -rs --tb=short -p no:cacheprovider)
# Such a machine may lack the suite's other test dependencies (hypothesis, pytest-timeout,
# scikit-learn, mpi4py): modules that cannot be imported are reported, not fatal.
[ "$DRY_RUN" != 1 ] && "$PY" -c "import pytest_timeout" 2>/dev/null \
  && pytest_opts+=(--timeout=120)

# Budgets (seconds) add up to 470: within the default deadline, with room for the shell.
step env 15 bash -c "nvidia-smi; $PY -c 'import sys, numpy, cupy, torch; \
print(sys.version); print(\"numpy\", numpy.__version__, \"cupy\", cupy.__version__, \
\"torch\", torch.__version__, \"torch.cuda\", torch.cuda.is_available())'"
# The C++ CPU backend (the CPU reference path of the device-parametrised tests).
step build 75 "$PY" setup.py build_ext --inplace
step cuda_available 30 "$PY" -c "
import needle.backend_ndarray as nd
from needle.backend_ndarray import devices, ndarray_backend_cuda as B
print('cuda enabled:', nd.cuda().enabled(), devices._LOAD_ERRORS)
assert nd.cuda().enabled(), 'cuda() is disabled'
a = B.Array(4); B.fill(a, 1.0)  # compiles strided.cu once (NVRTC), cached afterwards
print(B.to_numpy(a, (4,), (1,), 0))"
# The backend's own kernel tests on the device (every entry point x dtype x view, every
# reduction path).
step test_cuda_backend 60 "$PY" -m pytest python_tests/backend_ndarray/test_cuda_backend.py \
  python_tests/backend_ndarray/test_cuda_launch.py \
  python_tests/backend_ndarray/test_cuda_reductions.py "${pytest_opts[@]}"
# Eager, compiled and graph-replayed training steps on the device: bitwise the same.
step compiled_equality 30 "$PY" bench/gpu_equality.py
# The graph-replay and NCCL tests that run on the device (their emulated variants, which
# compile every kernel with g++ first, are left to CPU machines like the rest of the emulator).
step graph_replay 25 "$PY" -m pytest python_tests/compiler/test_graph_replay_device.py \
  "${pytest_opts[@]}"
step nccl 40 "$PY" -m pytest python_tests/distributed/test_nccl_device.py "${pytest_opts[@]}"
step bench_gpu 60 "$PY" bench/bench_gpu.py ${BENCH_GPU_ARGS:-}
# The host side of a step with no-op kernels (what is left when the GPU is infinitely fast).
step cuda_host_time 20 "$PY" bench/cuda_host_time.py
# Where a cuda() training step spends its time: launches per kernel family, cProfile, the
# host cost of one launch, elementwise kernel shapes.
step gpu_profile 25 "$PY" bench/gpu_profile.py
# Every device-parametrised test of the suite, cuda case only (the emulator's own tests
# are left to CPU machines: here the real kernels ran above). Last: it takes what is left.
step test_suite_cuda 90 "$PY" -m pytest python_tests -k "cuda and not emulat" -m "not mpi" \
  --continue-on-collection-errors "${pytest_opts[@]}"

device=$( [ "$DRY_RUN" = 1 ] && echo "dry run" || nvidia-smi --query-gpu=name,driver_version \
  --format=csv,noheader 2>/dev/null | head -1)
{
  echo "# needle GPU check"
  echo
  echo "${device:-no GPU found}; commit $commit; $(date -u +%Y-%m-%dT%H:%MZ);" \
    "$failed step(s) failed; deadline ${DEADLINE} s, used $(now) s"
  echo
  echo "| step | status | seconds | limit | key numbers |"
  echo "|---|---|---|---|---|"
  cat "$rows"
} > "$OUT/summary.md"
rm -f "$rows"
echo "=== $failed step(s) failed; summary in $OUT/summary.md"
exit "$failed"
