// Training-mode batch normalisation of x viewed as (n, c, s): s = 1 for (N, C) rows and for
// the channels-last (N*H*W, C) rows of an NHWC convolution output, s = H*W for compact NCHW.
// Channel ch holds the m = n*s elements (i, ch, j), at (i*c + ch)*s + j.
//
// Two launches each way: a statistics kernel with one block per channel (grid-stride over
// channels) that sums in double in a fixed order (the same bits on every run), then an
// elementwise kernel. Statistics are two-pass (mean, then the squared deviations), as the
// NumPy reference computes them. With relu != 0 a ReLU follows the batch norm: the forward
// stores max(y, 0) and the backward first masks dy by the saved output r, each rounded as
// scalar_maximum and ewise_relu_grad round (the same bits as the two ops one after another).
#include "common.cuh"

__device__ __forceinline__ long long bn_at(long long q, long long ch, long long c, long long s) {
  return ((q / s) * c + ch) * s + q % s;
}

// mean, biased var and invstd = 1/sqrt(var + eps) per channel.
template <typename T>
__device__ __forceinline__ void bn_stats_body(const T* __restrict__ x, T* __restrict__ mean,
                                              T* __restrict__ var, T* __restrict__ invstd,
                                              long long n, long long c, long long s, T eps) {
  __shared__ double shared_mean;
  const long long m = n * s;
  for (long long ch = blockIdx.x; ch < c; ch += gridDim.x) {
    double sum = 0.0;
    for (long long q = threadIdx.x; q < m; q += blockDim.x) {
      sum += (double)Traits<T>::load(x[bn_at(q, ch, c, s)]);
    }
    sum = block_reduce<double, RedSum>(sum);
    if (threadIdx.x == 0) shared_mean = sum / (double)m;
    __syncthreads();
    const double mu = shared_mean;
    double squares = 0.0;
    for (long long q = threadIdx.x; q < m; q += blockDim.x) {
      const double d = (double)Traits<T>::load(x[bn_at(q, ch, c, s)]) - mu;
      squares += d * d;
    }
    squares = block_reduce<double, RedSum>(squares);
    if (threadIdx.x == 0) {
      const double v = squares / (double)m;
      mean[ch] = Traits<T>::store(mu);
      var[ch] = Traits<T>::store(v);
      invstd[ch] = Traits<T>::store(1.0 / sqrt(v + (double)Traits<T>::load(eps)));
    }
    __syncthreads();  // shared_mean is written again for the next channel
  }
}

// y = w (x - mean) invstd + b, then max(y, 0) when relu.
template <typename T>
__device__ __forceinline__ void bn_apply_body(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ b,
                                              const T* __restrict__ mean,
                                              const T* __restrict__ invstd, T* __restrict__ y,
                                              long long n, long long c, long long s,
                                              long long relu) {
  NEEDLE_FOR_EACH(e, n * c * s) {
    const long long ch = (e / s) % c;
    const double scale = (double)Traits<T>::load(w[ch]) * (double)Traits<T>::load(invstd[ch]);
    const double centred = (double)Traits<T>::load(x[e]) - (double)Traits<T>::load(mean[ch]);
    const T v = Traits<T>::store(centred * scale + (double)Traits<T>::load(b[ch]));
    y[e] = relu ? nan_max(v, T(0)) : v;
  }
}

// dy, masked by the ReLU's output r when relu.
template <typename T>
__device__ __forceinline__ double bn_grad_at(const T* __restrict__ dy, const T* __restrict__ r,
                                             long long at, long long relu) {
  const T g = dy[at];
  return (double)Traits<T>::load(relu ? relu_grad_step(g, r[at]) : g);
}

// db = sum dy, dw = sum dy * xhat per channel, xhat = (x - mean) invstd.
template <typename T>
__device__ __forceinline__ void bn_grad_stats_body(const T* __restrict__ dy,
                                                   const T* __restrict__ x,
                                                   const T* __restrict__ mean,
                                                   const T* __restrict__ invstd,
                                                   const T* __restrict__ r,
                                                   T* __restrict__ dw, T* __restrict__ db,
                                                   long long n, long long c, long long s,
                                                   long long relu) {
  const long long m = n * s;
  for (long long ch = blockIdx.x; ch < c; ch += gridDim.x) {
    const double mu = (double)Traits<T>::load(mean[ch]);
    const double inv = (double)Traits<T>::load(invstd[ch]);
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    for (long long q = threadIdx.x; q < m; q += blockDim.x) {
      const long long at = bn_at(q, ch, c, s);
      const double g = bn_grad_at(dy, r, at, relu);
      sum_dy += g;
      sum_dy_xhat += g * (((double)Traits<T>::load(x[at]) - mu) * inv);
    }
    sum_dy = block_reduce<double, RedSum>(sum_dy);
    sum_dy_xhat = block_reduce<double, RedSum>(sum_dy_xhat);
    if (threadIdx.x == 0) {
      db[ch] = Traits<T>::store(sum_dy);
      dw[ch] = Traits<T>::store(sum_dy_xhat);
    }
  }
}

// dx = w invstd (dy - db/m - xhat dw/m).
template <typename T>
__device__ __forceinline__ void bn_grad_input_body(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
    const T* __restrict__ mean, const T* __restrict__ invstd, const T* __restrict__ dw,
    const T* __restrict__ db, const T* __restrict__ r, T* __restrict__ dx, long long n,
    long long c, long long s, long long relu) {
  const double m = (double)(n * s);
  NEEDLE_FOR_EACH(e, n * c * s) {
    const long long ch = (e / s) % c;
    const double inv = (double)Traits<T>::load(invstd[ch]);
    const double xhat = ((double)Traits<T>::load(x[e]) - (double)Traits<T>::load(mean[ch])) * inv;
    const double k = (double)Traits<T>::load(w[ch]) * inv;
    dx[e] = Traits<T>::store(k * (bn_grad_at(dy, r, e, relu) -
                                  (double)Traits<T>::load(db[ch]) / m -
                                  xhat * (double)Traits<T>::load(dw[ch]) / m));
  }
}

#define NEEDLE_BN_T(SUF, T)                                                                    \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) batch_norm_stats_##SUF(         \
      const T* __restrict__ x, T* __restrict__ mean, T* __restrict__ var,                      \
      T* __restrict__ invstd, long long n, long long c, long long s, T eps) {                  \
    bn_stats_body<T>(x, mean, var, invstd, n, c, s, eps);                                      \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) batch_norm_apply_##SUF(         \
      const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,               \
      const T* __restrict__ mean, const T* __restrict__ invstd, T* __restrict__ y,             \
      long long n, long long c, long long s, long long relu) {                                 \
    bn_apply_body<T>(x, w, b, mean, invstd, y, n, c, s, relu);                                 \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) batch_norm_grad_stats_##SUF(    \
      const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,           \
      const T* __restrict__ invstd, const T* __restrict__ r, T* __restrict__ dw,               \
      T* __restrict__ db, long long n, long long c, long long s, long long relu) {             \
    bn_grad_stats_body<T>(dy, x, mean, invstd, r, dw, db, n, c, s, relu);                      \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) batch_norm_grad_input_##SUF(    \
      const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,              \
      const T* __restrict__ mean, const T* __restrict__ invstd, const T* __restrict__ dw,      \
      const T* __restrict__ db, const T* __restrict__ r, T* __restrict__ dx, long long n,      \
      long long c, long long s, long long relu) {                                              \
    bn_grad_input_body<T>(dy, x, w, mean, invstd, dw, db, r, dx, n, c, s, relu);               \
  }

NEEDLE_BN_T(f32, float)
NEEDLE_BN_T(f64, double)
