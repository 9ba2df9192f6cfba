// Softmax cross-entropy over the rows of z (n x k) with integer class labels, forward and
// backward, one kernel each. Included inside `namespace needle::<isa>` by kernels_impl.h,
// after elementwise_impl.h (its vector exp).
//
//   lse_i = max_j z_ij + log sum_j exp(z_ij - max_j z_ij)     loss_i = lse_i - z_i,y_i
//   dz_ij = g_i (exp(z_ij - lse_i) - [j == y_i])
//
// The composed ops (max, a broadcast subtraction, exp, sum, log, a one-hot product, ...)
// make ~8 passes over the n x k logits forward and as many backward, each through a new
// buffer; these make two forward (max, then exp and sum as each exp is made) and one
// backward. Labels are checked by the caller (integers in [0, k)).

template <class T>
T xent_row_max(const T* z, std::size_t k) {
  T m = z[0];
#pragma omp simd reduction(max : m)
  for (std::size_t j = 1; j < k; ++j) m = z[j] > m ? z[j] : m;
  return m;
}

#if defined(__AVX512F__)
inline __m512 xent_vexp(__m512 x) { return exp16(x); }
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 xent_vexp(__m256 x) { return exp8(x); }
#endif

// sum_j exp(z_j - m) in double, one pass over the row: each exp is the vector exp of
// un_loop_plain (the same float per element as exponentiating a copy of z - m), summed into
// double lanes as it is made, with no scratch row written and read back. The widening to
// double lanes is written per instruction set (through a float array it ran ~20% slower).
template <class T>
double xent_exp_sum(const T* z, T m, std::size_t k) {
  std::size_t j = 0;
  double s = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (; j + 16 <= k; j += 16) {
      const __m512 e = xent_vexp(_mm512_sub_ps(_mm512_loadu_ps(z + j), vm));
      lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
      hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(
                                 _mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (; j + 8 <= k; j += 8) {
      const __m256 e = xent_vexp(_mm256_sub_ps(_mm256_loadu_ps(z + j), vm));
      lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
    s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
#endif
  for (; j < k; ++j) s += double(apply_un<UnOp::exp, T>(T(z[j] - m)));
  return s;
}

// out_j = g exp(z_j - l), one pass (the same floats as exponentiating z - l, then scaling).
template <class T>
void xent_scaled_exp(const T* z, T l, T g, T* out, std::size_t k) {
  std::size_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    using Z = Vec<float>;
    const typename Z::V neg_l = Z::set1(-l), vg = Z::set1(g);
    for (; j + Z::W <= k; j += Z::W) {
      Z::storeu(out + j, Z::mul(xent_vexp(Z::add(Z::loadu(z + j), neg_l)), vg));
    }
  }
#endif
  for (; j < k; ++j) out[j] = T(apply_un<UnOp::exp, T>(T(z[j] - l)) * g);
}

template <class T>
void xent_forward_t(const T* z, const T* labels, T* loss, T* lse, std::size_t n,
                    std::size_t k) {
  const std::size_t threshold = kParallelMinHeavyElements / (k ? k : 1) + 1;
  parallel_range(n, threshold, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t i = r0; i < r1; ++i) {
      const T* row = z + i * k;
      const T m = xent_row_max(row, k);
      const T l = T(double(m) + std::log(xent_exp_sum(row, m, k)));
      lse[i] = l;
      loss[i] = l - row[std::size_t(labels[i])];
    }
  }, 1);
}

template <class T>
void xent_backward_t(const T* z, const T* labels, const T* lse, const T* g, T* dz,
                     std::size_t n, std::size_t k) {
  const std::size_t threshold = kParallelMinHeavyElements / (k ? k : 1) + 1;
  parallel_range(n, threshold, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t i = r0; i < r1; ++i) {
      const T gi = g[i];
      T* out = dz + i * k;
      xent_scaled_exp(z + i * k, lse[i], gi, out, k);
      out[std::size_t(labels[i])] -= gi;
    }
  }, 1);
}

void xent_forward(DType t, const void* z, const void* labels, void* loss, void* lse,
                  std::size_t n, std::size_t k) {
  if (t == DType::f32) {
    xent_forward_t(static_cast<const float*>(z), static_cast<const float*>(labels),
                   static_cast<float*>(loss), static_cast<float*>(lse), n, k);
  } else if (t == DType::f64) {
    xent_forward_t(static_cast<const double*>(z), static_cast<const double*>(labels),
                   static_cast<double*>(loss), static_cast<double*>(lse), n, k);
  } else {
    throw std::invalid_argument("softmax_xent_forward: expected float32 or float64");
  }
}

void xent_backward(DType t, const void* z, const void* labels, const void* lse, const void* g,
                   void* dz, std::size_t n, std::size_t k) {
  if (t == DType::f32) {
    xent_backward_t(static_cast<const float*>(z), static_cast<const float*>(labels),
                    static_cast<const float*>(lse), static_cast<const float*>(g),
                    static_cast<float*>(dz), n, k);
  } else if (t == DType::f64) {
    xent_backward_t(static_cast<const double*>(z), static_cast<const double*>(labels),
                    static_cast<const double*>(lse), static_cast<const double*>(g),
                    static_cast<double*>(dz), n, k);
  } else {
    throw std::invalid_argument("softmax_xent_backward: expected float32 or float64");
  }
}
