// The data movement of NHWC convolutions with a (KH, KW, C, Cout) kernel; the products are
// cuBLAS's (ndarray_backend_cuda.conv2d_*).
//
// The patch matrix `cols` is (N*HO*WO, KH*KW*C), row-major: row (n, oy, ox), column
// (ky, kx, c), the order of the kernel's rows, so that out = cols @ W (as (KH*KW*C, Cout)),
// dW = cols^T @ dy and the input gradient's patches are dy @ W^T. One thread per element of
// the matrix being written: consecutive threads take consecutive channels, so reads and
// writes are coalesced whenever C is more than a few.
#include "common.cuh"

// Decompose an output row r = (n, oy, ox) and a column k = (ky, kx, c).
struct ConvIndex {
  long long n, oy, ox, ky, kx, c;
};

__device__ __forceinline__ ConvIndex conv_index(long long row, long long k, long long c,
                                               long long kw, long long ho, long long wo) {
  ConvIndex at;
  at.c = k % c;
  const long long tap = k / c;
  at.kx = tap % kw;
  at.ky = tap / kw;
  at.ox = row % wo;
  const long long rest = row / wo;
  at.oy = rest % ho;
  at.n = rest / ho;
  return at;
}

// cols[r, k] = x[n, oy*stride - pad + ky, ox*stride - pad + kx, c], zero outside the image.
template <typename T>
__device__ __forceinline__ void im2col_body(const T* __restrict__ x, T* __restrict__ cols,
                                            long long n, long long h, long long w, long long c,
                                            long long kh, long long kw, long long stride,
                                            long long pad, long long ho, long long wo) {
  const long long width = kh * kw * c;
  NEEDLE_FOR_EACH(i, n * ho * wo * width) {
    const long long row = i / width;
    const ConvIndex at = conv_index(row, i - row * width, c, kw, ho, wo);
    const long long iy = at.oy * stride - pad + at.ky, ix = at.ox * stride - pad + at.kx;
    const bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w;
    cols[i] = inside ? x[((at.n * h + iy) * w + ix) * c + at.c] : T(0);
  }
}

// dx[n, iy, ix, c] = the sum of cols[(n, oy, ox), (ky, kx, c)] over the taps that read
// (iy, ix), i.e. iy = oy*stride - pad + ky and likewise for x. One thread per element of dx
// gathers its taps in (ky, kx) order: no atomics, and the same sum on every run.
template <typename T>
__device__ __forceinline__ void col2im_body(const T* __restrict__ cols, T* __restrict__ dx,
                                            long long n, long long h, long long w, long long c,
                                            long long kh, long long kw, long long stride,
                                            long long pad, long long ho, long long wo) {
  const long long width = kh * kw * c;
  NEEDLE_FOR_EACH(i, n * h * w * c) {
    const long long ci = i % c;
    long long rest = i / c;
    const long long ix = rest % w;
    rest /= w;
    const long long iy = rest % h, ni = rest / h;
    T acc = T(0);
    for (long long ky = 0; ky < kh; ++ky) {
      const long long ty = iy + pad - ky;  // = oy * stride for the output row that reads it
      if (ty < 0 || ty % stride != 0 || ty / stride >= ho) continue;
      const long long oy = ty / stride;
      for (long long kx = 0; kx < kw; ++kx) {
        const long long tx = ix + pad - kx;
        if (tx < 0 || tx % stride != 0 || tx / stride >= wo) continue;
        const long long row = (ni * ho + oy) * wo + tx / stride;
        acc += cols[row * width + (ky * kw + kx) * c + ci];
      }
    }
    dx[i] = acc;
  }
}

#define NEEDLE_CONV_T(SUF, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) im2col_##SUF(                  \
      const T* __restrict__ x, T* __restrict__ cols, long long n, long long h, long long w,   \
      long long c, long long kh, long long kw, long long stride, long long pad, long long ho, \
      long long wo) {                                                                         \
    im2col_body<T>(x, cols, n, h, w, c, kh, kw, stride, pad, ho, wo);                         \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) col2im_##SUF(                  \
      const T* __restrict__ cols, T* __restrict__ dx, long long n, long long h, long long w,  \
      long long c, long long kh, long long kw, long long stride, long long pad, long long ho, \
      long long wo) {                                                                         \
    col2im_body<T>(cols, dx, n, h, w, c, kh, kw, stride, pad, ho, wo);                        \
  }

NEEDLE_CONV_T(f32, float)
NEEDLE_CONV_T(f64, double)
