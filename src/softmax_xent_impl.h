// Softmax cross-entropy over the rows of z (n x k) with integer class labels, forward and
// backward, one kernel each. Included inside `namespace needle::<isa>` by kernels_impl.h,
// after elementwise_impl.h (its vector exp).
//
//   lse_i = max_j z_ij + log sum_j exp(z_ij - max_j z_ij)     loss_i = lse_i - z_i,y_i
//   dz_ij = g_i (exp(z_ij - lse_i) - [j == y_i])
//
// The composed ops (max, a broadcast subtraction, exp, sum, log, a one-hot product, ...)
// make ~8 passes over the n x k logits forward and as many backward, each through a new
// buffer; these make two forward (max, then exp and sum into a row scratch) and one
// backward. Labels are checked by the caller (integers in [0, k)).

template <class T>
T xent_row_max(const T* z, std::size_t k) {
  T m = z[0];
#pragma omp simd reduction(max : m)
  for (std::size_t j = 1; j < k; ++j) m = z[j] > m ? z[j] : m;
  return m;
}

template <class T>
void xent_forward_t(const T* z, const T* labels, T* loss, T* lse, std::size_t n,
                    std::size_t k) {
  const std::size_t threshold = kParallelMinHeavyElements / (k ? k : 1) + 1;
  parallel_range(n, threshold, [&](std::size_t r0, std::size_t r1) {
    std::vector<T> scratch(k);
    for (std::size_t i = r0; i < r1; ++i) {
      const T* row = z + i * k;
      const T m = xent_row_max(row, k);
      for (std::size_t j = 0; j < k; ++j) scratch[j] = row[j] - m;
      un_loop_plain<UnOp::exp, T>(scratch.data(), scratch.data(), k);
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (std::size_t j = 0; j < k; ++j) s += double(scratch[j]);
      const T l = T(double(m) + std::log(s));
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
      const T* row = z + i * k;
      T* out = dz + i * k;
      const T l = lse[i], gi = g[i];
      for (std::size_t j = 0; j < k; ++j) out[j] = row[j] - l;
      un_loop_plain<UnOp::exp, T>(out, out, k);
#pragma omp simd
      for (std::size_t j = 0; j < k; ++j) out[j] *= gi;
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
