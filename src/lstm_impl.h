// The LSTM cell's gate arithmetic, forward and backward, in one pass each. Included inside
// `namespace needle::<isa>` by kernels_impl.h.
//
// Forward, per batch row (z = x W_ih + h W_hh, B x 4H, gate blocks i, f, g, o; a layer over
// a sequence passes x W_ih of every step in one buffer as z_add and h W_hh as z, and the
// kernel adds the two as the separate addition would, so no step's rows are copied out):
//   i = sigmoid(z_i + b_i)  f = sigmoid(z_f + b_f)  g = tanh(z_g + b_g)  o = sigmoid(z_o + b_o)
//   c' = f c + i g          h' = o tanh(c')
// writing h', c', the four activations and tanh(c') (what backward needs). Backward, from the
// gradients dh', dc' of the outputs:
//   dct = dc' + dh' o (1 - tanh(c')^2)
//   dz_i = dct g i (1 - i)   dz_f = dct c f (1 - f)   dz_g = dct i (1 - g^2)
//   dz_o = dh' tanh(c') o (1 - o)                     dc = dct f
// float32 uses the vector sigmoid/tanh of elementwise_impl.h; float64 libm.

template <class T>
inline T lstm_sigmoid(T x) { return apply_un<UnOp::sigmoid, T>(x); }
template <class T>
inline T lstm_tanh(T x) { return apply_un<UnOp::tanh, T>(x); }

// One row's gates, elements [j0, j1) of each gate block (scalar path, any dtype).
template <class T>
void lstm_row_forward_scalar(const T* z, const T* z_add, const T* bias, const T* c, T* h2,
                             T* c2, T* gates, T* tc, std::size_t hidden, std::size_t j0,
                             std::size_t j1) {
  for (std::size_t j = j0; j < j1; ++j) {
    T pre[4];
    for (std::size_t q = 0; q < 4; ++q) {
      pre[q] = z_add ? z_add[q * hidden + j] + z[q * hidden + j] : z[q * hidden + j];
      pre[q] = pre[q] + (bias ? bias[q * hidden + j] : T(0));
    }
    const T i = lstm_sigmoid(pre[0]), f = lstm_sigmoid(pre[1]);
    const T g = lstm_tanh(pre[2]), o = lstm_sigmoid(pre[3]);
    const T cn = f * c[j] + i * g, t = lstm_tanh(cn);
    gates[j] = i; gates[hidden + j] = f; gates[2 * hidden + j] = g; gates[3 * hidden + j] = o;
    c2[j] = cn; tc[j] = t; h2[j] = o * t;
  }
}

#if defined(__AVX512F__)
inline __m512 lstm_vsigmoid(__m512 x) { return sigmoid16(x); }
inline __m512 lstm_vtanh(__m512 x) { return tanh16(x); }
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 lstm_vsigmoid(__m256 x) { return sigmoid8(x); }
inline __m256 lstm_vtanh(__m256 x) { return tanh8(x); }
#endif

template <class T>
void lstm_row_forward(const T* z, const T* z_add, const T* bias, const T* c, T* h2, T* c2,
                      T* gates, T* tc, std::size_t hidden) {
  std::size_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    using Z = Vec<float>;
    using V = typename Z::V;
    for (; j + Z::W <= hidden; j += Z::W) {
      V pre[4];
      for (std::size_t q = 0; q < 4; ++q) {
        pre[q] = Z::loadu(z + q * hidden + j);
        if (z_add) pre[q] = Z::add(Z::loadu(z_add + q * hidden + j), pre[q]);
        if (bias) pre[q] = Z::add(pre[q], Z::loadu(bias + q * hidden + j));
      }
      const V i = lstm_vsigmoid(pre[0]), f = lstm_vsigmoid(pre[1]);
      const V g = lstm_vtanh(pre[2]), o = lstm_vsigmoid(pre[3]);
      const V cn = Z::fma(f, Z::loadu(c + j), Z::mul(i, g)), t = lstm_vtanh(cn);
      Z::storeu(gates + j, i);
      Z::storeu(gates + hidden + j, f);
      Z::storeu(gates + 2 * hidden + j, g);
      Z::storeu(gates + 3 * hidden + j, o);
      Z::storeu(c2 + j, cn);
      Z::storeu(tc + j, t);
      Z::storeu(h2 + j, Z::mul(o, t));
    }
  }
#endif
  lstm_row_forward_scalar(z, z_add, bias, c, h2, c2, gates, tc, hidden, j, hidden);
}

template <class T>
void lstm_forward_t(const T* z, const T* z_add, const T* bias, const T* c, T* h2, T* c2,
                    T* gates, T* tc, std::size_t batch, std::size_t hidden) {
  const std::size_t width = 4 * hidden;
  parallel_range(batch, kParallelMinHeavyElements / (width + 1) + 1, [&](std::size_t b0,
                                                                        std::size_t b1) {
    for (std::size_t b = b0; b < b1; ++b) {
      lstm_row_forward(z + b * width, z_add ? z_add + b * width : nullptr, bias,
                       c + b * hidden, h2 + b * hidden, c2 + b * hidden, gates + b * width,
                       tc + b * hidden, hidden);
    }
  }, 1);
}

// ADD: dh' is dh + dh_add (a template flag, so that the common loop has no branch).
template <class T, bool ADD>
void lstm_backward_t(const T* gates, const T* tc, const T* c, const T* dh, const T* dh_add,
                     const T* dc, T* dz, T* dc_prev, std::size_t batch, std::size_t hidden) {
  const std::size_t width = 4 * hidden;
  parallel_range(batch, kParallelMinElements / (width + 1) + 1, [&](std::size_t b0,
                                                                   std::size_t b1) {
    for (std::size_t b = b0; b < b1; ++b) {
      const T* gi = gates + b * width;
      const T *gf = gi + hidden, *gg = gi + 2 * hidden, *go = gi + 3 * hidden;
      const T *t = tc + b * hidden, *cr = c + b * hidden, *dhr = dh + b * hidden;
      const T* dha = ADD ? dh_add + b * hidden : nullptr;
      const T* dcr = dc + b * hidden;
      T* dzr = dz + b * width;
      T* dcp = dc_prev + b * hidden;
#pragma omp simd
      for (std::size_t j = 0; j < hidden; ++j) {
        const T i = gi[j], f = gf[j], g = gg[j], o = go[j], tj = t[j];
        T dhj = dhr[j];
        if constexpr (ADD) dhj = dha[j] + dhj;
        const T dct = dcr[j] + dhj * o * (T(1) - tj * tj);
        dzr[j] = dct * g * i * (T(1) - i);
        dzr[hidden + j] = dct * cr[j] * f * (T(1) - f);
        dzr[2 * hidden + j] = dct * i * (T(1) - g * g);
        dzr[3 * hidden + j] = dhj * tj * o * (T(1) - o);
        dcp[j] = dct * f;
      }
    }
  }, 1);
}

template <class T>
void lstm_backward_as(const void* gates, const void* tc, const void* c, const void* dh,
                      const void* dh_add, const void* dc, void* dz, void* dc_prev,
                      std::size_t batch, std::size_t hidden) {
  const auto in = [](const void* p) { return static_cast<const T*>(p); };
  if (dh_add) {
    lstm_backward_t<T, true>(in(gates), in(tc), in(c), in(dh), in(dh_add), in(dc),
                             static_cast<T*>(dz), static_cast<T*>(dc_prev), batch, hidden);
  } else {
    lstm_backward_t<T, false>(in(gates), in(tc), in(c), in(dh), nullptr, in(dc),
                              static_cast<T*>(dz), static_cast<T*>(dc_prev), batch, hidden);
  }
}

void lstm_forward(DType t, const void* z, const void* z_add, const void* bias, const void* c,
                  void* h2, void* c2, void* gates, void* tc, std::size_t batch,
                  std::size_t hidden) {
  if (t == DType::f32) {
    return lstm_forward_t(static_cast<const float*>(z), static_cast<const float*>(z_add),
                          static_cast<const float*>(bias), static_cast<const float*>(c),
                          static_cast<float*>(h2), static_cast<float*>(c2),
                          static_cast<float*>(gates), static_cast<float*>(tc), batch, hidden);
  }
  lstm_forward_t(static_cast<const double*>(z), static_cast<const double*>(z_add),
                 static_cast<const double*>(bias), static_cast<const double*>(c),
                 static_cast<double*>(h2), static_cast<double*>(c2),
                 static_cast<double*>(gates), static_cast<double*>(tc), batch, hidden);
}

void lstm_backward(DType t, const void* gates, const void* tc, const void* c, const void* dh,
                   const void* dh_add, const void* dc, void* dz, void* dc_prev,
                   std::size_t batch, std::size_t hidden) {
  if (t == DType::f32) {
    return lstm_backward_as<float>(gates, tc, c, dh, dh_add, dc, dz, dc_prev, batch, hidden);
  }
  lstm_backward_as<double>(gates, tc, c, dh, dh_add, dc, dz, dc_prev, batch, hidden);
}
