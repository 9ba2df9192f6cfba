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
# Both variants the loader may compile: CUDA's own __half / __nv_bfloat16, and the two-byte
# structs it falls back to (-DNEEDLE_OWN_HALF) when NVRTC cannot compile those headers.
for variant in "" "-DNEEDLE_OWN_HALF"; do
  for f in "${files[@]}"; do
    nvcc --ptx -arch=sm_90 -std=c++17 $variant -o "$out/$(basename "$f" .cu).ptx" "$f"
    echo "compiled $f ${variant:-(cuda_fp16.h, cuda_bf16.h)}"
  done
done
rm -rf "$out"
