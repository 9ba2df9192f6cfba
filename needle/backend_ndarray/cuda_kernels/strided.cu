// Strided kernels: fill, compact (gather a strided view), ewise_setitem (scatter into a view),
// scalar_setitem. Strides and offsets are signed element counts, so flipped views work; the
// view arrives by value as a StridedView (see common.cuh), at most 8 dims after the launcher
// merged mergeable dims.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void fill_body(T* __restrict__ out, T val, long long n) {
  NEEDLE_FOR_EACH(i, n) { out[i] = val; }
}

template <typename T>
__device__ __forceinline__ void compact_body(const T* __restrict__ a, T* __restrict__ out,
                                             StridedView v) {
  NEEDLE_FOR_EACH(i, v.size) { out[i] = a[view_offset(v, i)]; }
}

template <typename T>
__device__ __forceinline__ void ewise_setitem_body(const T* __restrict__ a, T* __restrict__ out,
                                                   StridedView v) {
  NEEDLE_FOR_EACH(i, v.size) { out[view_offset(v, i)] = a[i]; }
}

template <typename T>
__device__ __forceinline__ void scalar_setitem_body(T val, T* __restrict__ out, StridedView v) {
  NEEDLE_FOR_EACH(i, v.size) { out[view_offset(v, i)] = val; }
}

#define NEEDLE_STRIDED_T(SUF, T)                                                             \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      fill_##SUF(T* __restrict__ out, T val, long long n) {                                  \
    fill_body<T>(out, val, n);                                                               \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      compact_##SUF(const T* __restrict__ a, T* __restrict__ out, StridedView v) {           \
    compact_body<T>(a, out, v);                                                              \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      ewise_setitem_##SUF(const T* __restrict__ a, T* __restrict__ out, StridedView v) {     \
    ewise_setitem_body<T>(a, out, v);                                                        \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      scalar_setitem_##SUF(T val, T* __restrict__ out, StridedView v) {                      \
    scalar_setitem_body<T>(val, out, v);                                                     \
  }

NEEDLE_STRIDED_T(f32, float)
NEEDLE_STRIDED_T(f64, double)
NEEDLE_STRIDED_T(f16, half_t)
NEEDLE_STRIDED_T(bf16, bf16_t)
