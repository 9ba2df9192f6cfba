#!/usr/bin/env bash
# Compile every CUDA source to PTX so that a syntax error fails CI even without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
files=(needle/backend_ndarray/cuda_kernels/*.cu)
if [ ${#files[@]} -eq 0 ]; then
  echo "compile_cuda_sources: no .cu files"
  exit 0
fi
out=$(mktemp -d)
for f in "${files[@]}"; do
  nvcc --ptx -arch=sm_90 -std=c++17 -o "$out/$(basename "$f" .cu).ptx" "$f"
  echo "compiled $f"
done
rm -rf "$out"
