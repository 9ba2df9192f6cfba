// Shared definitions of needle's CUDA kernels: element types, the float16 and bfloat16 types,
// the strided view struct and the elementwise functors.
//
// Every .cu file includes this header. The Python loader (needle/backend_ndarray/_cuda/runtime.py)
// pastes it into each source before handing it to NVRTC, so that CuPy's on-disk kernel cache,
// which hashes the source text, sees header changes; nvcc (CI: bench/compile_cuda_sources.sh)
// finds it next to the .cu file.
#pragma once

// float16: CUDA's own __half when cuda_fp16.h is reachable, else a two-byte struct converted
// with the PTX cvt instructions (the loader retries with -DNEEDLE_OWN_HALF when NVRTC cannot
// compile cuda_fp16.h, which happens with some CuPy wheel / toolkit combinations).
#if !defined(NEEDLE_OWN_HALF) && defined(__has_include)
#if __has_include(<cuda_fp16.h>)
#include <cuda_fp16.h>
#define NEEDLE_CUDA_FP16 1
#endif
#endif
// bfloat16 likewise: __nv_bfloat16 from cuda_bf16.h, else a two-byte struct (same retry flag).
#if !defined(NEEDLE_OWN_HALF) && defined(__has_include)
#if __has_include(<cuda_bf16.h>)
#include <cuda_bf16.h>
#define NEEDLE_CUDA_BF16 1
#endif
#endif

#define NEEDLE_THREADS 256
#define NEEDLE_MAX_DIMS 8

#ifdef NEEDLE_CUDA_FP16
typedef __half half_t;
__device__ __forceinline__ float half_to_float(half_t h) { return __half2float(h); }
__device__ __forceinline__ half_t half_from_float(float f) { return __float2half_rn(f); }
__device__ __forceinline__ half_t half_from_double(double d) { return __double2half(d); }
#else
struct __align__(2) half_t {
  unsigned short bits;
};
#if defined(NEEDLE_HOST_EMULATION)
// Host emulation of the kernels for tests without a GPU: the shim converts in software.
__device__ __forceinline__ float half_to_float(half_t h) { return emu_half_to_float(h.bits); }
__device__ __forceinline__ half_t half_from_float(float f) { return {emu_half_from_float(f)}; }
__device__ __forceinline__ half_t half_from_double(double d) { return {emu_half_from_double(d)}; }
#else
__device__ __forceinline__ float half_to_float(half_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}
__device__ __forceinline__ half_t half_from_float(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
__device__ __forceinline__ half_t half_from_double(double d) {
  half_t h;
  asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h.bits) : "d"(d));
  return h;
}
#endif
#endif

// bfloat16 is the top half of a float32: widening is a shift and narrowing rounds to nearest
// even on the bits, the same code with or without cuda_bf16.h (whose conversions differ
// between toolkits); NaN stays a quiet NaN of the same sign.
#ifdef NEEDLE_CUDA_BF16
typedef __nv_bfloat16 bf16_t;
__device__ __forceinline__ unsigned short bf16_bits(bf16_t h) { return __bfloat16_as_ushort(h); }
__device__ __forceinline__ bf16_t bf16_of_bits(unsigned short b) { return __ushort_as_bfloat16(b); }
#else
struct __align__(2) bf16_t {
  unsigned short bits;
};
__device__ __forceinline__ unsigned short bf16_bits(bf16_t h) { return h.bits; }
__device__ __forceinline__ bf16_t bf16_of_bits(unsigned short b) {
  bf16_t h;
  h.bits = b;
  return h;
}
#endif
__device__ __forceinline__ float bf16_to_float(bf16_t h) {
  return __int_as_float((int)((unsigned int)bf16_bits(h) << 16));
}
__device__ __forceinline__ bf16_t bf16_from_float(float f) {
  unsigned int bits = (unsigned int)__float_as_int(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16_of_bits((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // carries exactly when the dropped half rounds up
  return bf16_of_bits((unsigned short)(bits >> 16));
}
// double -> bfloat16 with one rounding: to float rounding toward zero with the inexact flag
// kept in the lowest bit (round to odd; float has 16 more bits than bfloat16), then to
// nearest even.
__device__ __forceinline__ bf16_t bf16_from_double(double d) {
  const float f = __double2float_rz(d);
  int bits = __float_as_int(f);
  if ((double)f != d) bits |= 1;
  return bf16_from_float(__int_as_float(bits));
}

// Traits<T>::acc is the type a kernel computes in (float for float16 and bfloat16); load
// widens, store rounds once.
template <typename T>
struct Traits {
  typedef T acc;
  static __device__ __forceinline__ T load(T v) { return v; }
  static __device__ __forceinline__ T store(T v) { return v; }
};

template <>
struct Traits<half_t> {
  typedef float acc;
  static __device__ __forceinline__ float load(half_t v) { return half_to_float(v); }
  static __device__ __forceinline__ half_t store(float v) { return half_from_float(v); }
};

template <>
struct Traits<bf16_t> {
  typedef float acc;
  static __device__ __forceinline__ float load(bf16_t v) { return bf16_to_float(v); }
  static __device__ __forceinline__ bf16_t store(float v) { return bf16_from_float(v); }
};

// Conversion between any two element types with one rounding (double -> half and double ->
// bfloat16 go directly, as NumPy's astype does, not through float).
template <typename Out, typename In>
struct Convert {
  static __device__ __forceinline__ Out apply(In v) {
    return Traits<Out>::store(static_cast<typename Traits<Out>::acc>(Traits<In>::load(v)));
  }
};
template <>
struct Convert<half_t, double> {
  static __device__ __forceinline__ half_t apply(double v) { return half_from_double(v); }
};
template <>
struct Convert<bf16_t, double> {
  static __device__ __forceinline__ bf16_t apply(double v) { return bf16_from_double(v); }
};

// A strided view: up to NEEDLE_MAX_DIMS dims, passed to kernels by value. All fields are
// 64-bit so the host side (a NumPy structured array of int64) has the same layout with no
// padding questions.
struct StridedView {
  long long size;
  long long offset;
  long long ndim;
  long long shape[NEEDLE_MAX_DIMS];
  long long strides[NEEDLE_MAX_DIMS];
};

// Element offset in the underlying buffer of the i-th element (row-major order) of the view.
// Sizes below 2^31 use 32-bit division, several times cheaper than 64-bit division on a GPU.
__device__ __forceinline__ long long view_offset(const StridedView& v, long long i) {
  long long off = v.offset;
  if (v.size <= 0x7fffffffLL) {
    unsigned int rest = (unsigned int)i;
#pragma unroll
    for (int d = NEEDLE_MAX_DIMS - 1; d >= 0; --d) {
      if (d < v.ndim) {
        unsigned int n = (unsigned int)v.shape[d];
        unsigned int q = rest / n;
        off += (long long)(rest - q * n) * v.strides[d];
        rest = q;
      }
    }
  } else {
#pragma unroll
    for (int d = NEEDLE_MAX_DIMS - 1; d >= 0; --d) {
      if (d < v.ndim) {
        long long q = i / v.shape[d];
        off += (i - q * v.shape[d]) * v.strides[d];
        i = q;
      }
    }
  }
  return off;
}

// Grid-stride loop over [0, n): correct for any grid, and the launcher's grid normally gives
// one element per thread.
#define NEEDLE_FOR_EACH(i, n)                                                          \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);        \
       i += (long long)gridDim.x * blockDim.x)

// Math in the compute type, overloaded so templates pick the float or double routine.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }

// NaN-propagating max/min, as NumPy's maximum/minimum and max/min reductions.
template <typename A>
__device__ __forceinline__ A nan_max(A a, A b) {
  return (a != a || a > b) ? a : b;
}
template <typename A>
__device__ __forceinline__ A nan_min(A a, A b) {
  return (a != a || a < b) ? a : b;
}

// relu's backward from its output r: g * sign(r), with sign(+-0) = r itself and sign(NaN) =
// NaN (elementwise.cu's ewise_relu_grad; batch_norm.cu's kernels fused with a ReLU).
template <typename A>
__device__ __forceinline__ A relu_grad_step(A g, A r) {
  return g * (r > A(0) ? A(1) : (r < A(0) ? A(-1) : r));
}

// ---- block-wide reductions (reduce.cu's row reductions, fused.cu's softmax rows) ----------
// +inf without <math.h>'s INFINITY macro (not always defined under NVRTC).
template <typename A> __device__ __forceinline__ A inf_value();
template <> __device__ __forceinline__ float inf_value<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double inf_value<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}

struct RedSum {
  template <typename A> static __device__ A identity() { return A(0); }
  template <typename A> static __device__ A combine(A a, A b) { return a + b; }
};
struct RedMax {
  template <typename A> static __device__ A identity() { return -inf_value<A>(); }
  template <typename A> static __device__ A combine(A a, A b) { return nan_max(a, b); }
};
struct RedMin {
  template <typename A> static __device__ A identity() { return inf_value<A>(); }
  template <typename A> static __device__ A combine(A a, A b) { return nan_min(a, b); }
};

// Combine one value per thread of the block; the result is valid in thread 0.
// Needs blockDim.x to be a multiple of 32 (the launcher always uses 256).
template <typename A, typename Op>
__device__ __forceinline__ A block_reduce(A v) {
  __shared__ A warp_partials[NEEDLE_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    v = Op::template combine<A>(v, __shfl_down_sync(0xffffffffu, v, delta));
  }
  if (lane == 0) warp_partials[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x >> 5;
    v = lane < n_warps ? warp_partials[lane] : Op::template identity<A>();
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) {
      v = Op::template combine<A>(v, __shfl_down_sync(0xffffffffu, v, delta));
    }
  }
  __syncthreads();  // warp_partials may be reused by the caller's next iteration
  return v;
}
