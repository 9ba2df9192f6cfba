// Batch normalisation in training mode, forward and backward, one kernel each. Included inside
// `namespace needle::<isa>` by kernels_impl.h.
//
// x is compact (N, C, S): N samples, C channels, S positions per channel (S = 1 for
// BatchNorm1d's (N, C) rows, S = H*W for an NCHW BatchNorm2d input). Over the M = N*S values of
// each channel c:
//   mean_c = sum x / M      var_c = sum (x - mean_c)^2 / M (biased, two passes)
//   invstd_c = 1 / sqrt(var_c + eps)      y = w_c (x - mean_c) invstd_c + b_c
// Backward, from dy and the saved mean and invstd (xhat = (x - mean) invstd):
//   db_c = sum dy      dw_c = sum dy xhat
//   dx = w_c invstd_c / M (M dy - db_c - xhat dw_c)
// Sums accumulate in double, each channel on one thread in a fixed order, so the results do
// not depend on the number of threads. The composed ops (sum, broadcast, subtract, ...) read
// and write the activation ~10 times and, for NCHW, transpose it twice; this reads x twice
// and writes y once.

// sum over k < s of f(k), in double with eight independent partial sums (a single
// accumulator would chain every add on the previous one's latency; these vectorise).
template <class F>
inline double bn_lane_sum(std::size_t s, F&& f) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::size_t k = 0;
  for (; k + 8 <= s; k += 8) {
    for (std::size_t l = 0; l < 8; ++l) acc[l] += f(k + l);
  }
  double tail = 0;
  for (; k < s; ++k) tail += f(k);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) +
         tail;
}

// Runs fn(c0, c1) over channel blocks, on several threads when the tensor is large. S = 1
// rows are walked in blocks of 16 channels (a cache line of float32 per row).
template <class Fn>
void bn_parallel(std::size_t n, std::size_t c, std::size_t s, Fn&& fn) {
  const std::size_t total = n * c * s;
  const std::size_t grain = s == 1 ? 16 : 1;
  parallel_range(c, total >= kParallelMinElements ? 1 : ~std::size_t(0), fn, grain);
}

template <class T>
void bn_forward_t(const T* x, const T* w, const T* b, T* y, T* mean, T* var, T* invstd,
                  std::size_t n, std::size_t c, std::size_t s, double eps) {
  const double count = double(n) * double(s);
  bn_parallel(n, c, s, [&](std::size_t c0, std::size_t c1) {
    const std::size_t nb = c1 - c0;
    std::vector<double> mu(nb, 0.0), sq(nb, 0.0);
    if (s == 1) {  // rows of C: per-channel accumulators, the channel loop vectorises
      for (std::size_t i = 0; i < n; ++i) {
        const T* r = x + i * c + c0;
        for (std::size_t j = 0; j < nb; ++j) mu[j] += double(r[j]);
      }
      for (std::size_t j = 0; j < nb; ++j) mu[j] /= count;
      for (std::size_t i = 0; i < n; ++i) {
        const T* r = x + i * c + c0;
        for (std::size_t j = 0; j < nb; ++j) {
          const double d = double(r[j]) - mu[j];
          sq[j] += d * d;
        }
      }
    } else {  // runs of S per (sample, channel)
      for (std::size_t j = 0; j < nb; ++j) {
        double total = 0;
        for (std::size_t i = 0; i < n; ++i) {
          const T* xs = x + (i * c + c0 + j) * s;
          total += bn_lane_sum(s, [xs](std::size_t k) { return double(xs[k]); });
        }
        const double m = total / count;
        double dev = 0;
        for (std::size_t i = 0; i < n; ++i) {
          const T* xs = x + (i * c + c0 + j) * s;
          dev += bn_lane_sum(s, [xs, m](std::size_t k) {
            const double d = double(xs[k]) - m;
            return d * d;
          });
        }
        mu[j] = m;
        sq[j] = dev;
      }
    }
    std::vector<T> m(nb), scale(nb), shift(nb);
    for (std::size_t j = 0; j < nb; ++j) {
      const std::size_t ch = c0 + j;
      const double v = sq[j] / count;
      const double inv = 1.0 / std::sqrt(v + eps);
      mean[ch] = m[j] = T(mu[j]);
      var[ch] = T(v);
      invstd[ch] = T(inv);
      scale[j] = T(double(w[ch]) * inv);
      shift[j] = b[ch];
    }
    // y = (x - mean) scale + b: centred first, so a large mean does not cancel digits away
    for (std::size_t i = 0; i < n; ++i) {
      if (s == 1) {
        const T* xr = x + i * c + c0;
        T* yr = y + i * c + c0;
        for (std::size_t j = 0; j < nb; ++j) yr[j] = (xr[j] - m[j]) * scale[j] + shift[j];
      } else {
        for (std::size_t j = 0; j < nb; ++j) {
          const T mj = m[j], sc = scale[j], sh = shift[j];
          const T* xs = x + (i * c + c0 + j) * s;
          T* ys = y + (i * c + c0 + j) * s;
          for (std::size_t k = 0; k < s; ++k) ys[k] = (xs[k] - mj) * sc + sh;
        }
      }
    }
  });
}

template <class T>
void bn_backward_t(const T* dy, const T* x, const T* w, const T* mean, const T* invstd, T* dx,
                   T* dw, T* db, std::size_t n, std::size_t c, std::size_t s) {
  const double count = double(n) * double(s);
  bn_parallel(n, c, s, [&](std::size_t c0, std::size_t c1) {
    const std::size_t nb = c1 - c0;
    std::vector<double> sdy(nb, 0.0), sdyx(nb, 0.0);  // sum dy, sum dy (x - mean)
    if (s == 1) {
      for (std::size_t i = 0; i < n; ++i) {
        const T* xr = x + i * c + c0;
        const T* gr = dy + i * c + c0;
        for (std::size_t j = 0; j < nb; ++j) {
          const double g = double(gr[j]);
          sdy[j] += g;
          sdyx[j] += g * (double(xr[j]) - double(mean[c0 + j]));
        }
      }
    } else {
      for (std::size_t j = 0; j < nb; ++j) {
        const double m = double(mean[c0 + j]);
        for (std::size_t i = 0; i < n; ++i) {
          const T* xs = x + (i * c + c0 + j) * s;
          const T* gs = dy + (i * c + c0 + j) * s;
          sdy[j] += bn_lane_sum(s, [gs](std::size_t k) { return double(gs[k]); });
          sdyx[j] += bn_lane_sum(s, [gs, xs, m](std::size_t k) {
            return double(gs[k]) * (double(xs[k]) - m);
          });
        }
      }
    }
    // dx = w invstd (dy - db / M - (x - mean) invstd dw / M) = k1 (dy - k3 - (x - mean) k2)
    std::vector<T> k1(nb), k2(nb), k3(nb), mu(nb);
    for (std::size_t j = 0; j < nb; ++j) {
      const std::size_t ch = c0 + j;
      const double inv = double(invstd[ch]);
      const double gw = sdyx[j] * inv;  // dw = sum dy xhat
      db[ch] = T(sdy[j]);
      dw[ch] = T(gw);
      k1[j] = T(double(w[ch]) * inv);
      k2[j] = T(gw * inv / count);
      k3[j] = T(sdy[j] / count);
      mu[j] = mean[ch];
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (s == 1) {
        const T* xr = x + i * c + c0;
        const T* gr = dy + i * c + c0;
        T* dr = dx + i * c + c0;
        for (std::size_t j = 0; j < nb; ++j)
          dr[j] = k1[j] * (gr[j] - k3[j] - (xr[j] - mu[j]) * k2[j]);
      } else {
        for (std::size_t j = 0; j < nb; ++j) {
          const T a1 = k1[j], a2 = k2[j], a3 = k3[j], m = mu[j];
          const std::size_t at = (i * c + c0 + j) * s;
          const T* xs = x + at;
          const T* gs = dy + at;
          T* ds = dx + at;
          for (std::size_t k = 0; k < s; ++k) ds[k] = a1 * (gs[k] - a3 - (xs[k] - m) * a2);
        }
      }
    }
  });
}

void bn_forward(DType t, const void* x, const void* w, const void* b, void* y, void* mean,
                void* var, void* invstd, std::size_t n, std::size_t c, std::size_t s,
                double eps) {
  if (t == DType::f32) {
    bn_forward_t(static_cast<const float*>(x), static_cast<const float*>(w),
                 static_cast<const float*>(b), static_cast<float*>(y), static_cast<float*>(mean),
                 static_cast<float*>(var), static_cast<float*>(invstd), n, c, s, eps);
  } else if (t == DType::f64) {
    bn_forward_t(static_cast<const double*>(x), static_cast<const double*>(w),
                 static_cast<const double*>(b), static_cast<double*>(y),
                 static_cast<double*>(mean), static_cast<double*>(var),
                 static_cast<double*>(invstd), n, c, s, eps);
  } else {
    throw std::invalid_argument("batch_norm_forward: expected float32 or float64");
  }
}

void bn_backward(DType t, const void* dy, const void* x, const void* w, const void* mean,
                 const void* invstd, void* dx, void* dw, void* db, std::size_t n, std::size_t c,
                 std::size_t s) {
  if (t == DType::f32) {
    bn_backward_t(static_cast<const float*>(dy), static_cast<const float*>(x),
                  static_cast<const float*>(w), static_cast<const float*>(mean),
                  static_cast<const float*>(invstd), static_cast<float*>(dx),
                  static_cast<float*>(dw), static_cast<float*>(db), n, c, s);
  } else if (t == DType::f64) {
    bn_backward_t(static_cast<const double*>(dy), static_cast<const double*>(x),
                  static_cast<const double*>(w), static_cast<const double*>(mean),
                  static_cast<const double*>(invstd), static_cast<double*>(dx),
                  static_cast<double*>(dw), static_cast<double*>(db), n, c, s);
  } else {
    throw std::invalid_argument("batch_norm_backward: expected float32 or float64");
  }
}
