// Vector traits shared by the kernels: V256<T> (AVX2: __m256 / __m256d) and V512<T> (AVX-512:
// __m512 / __m512d) with the same static functions (loads, stores, masked edge access, FMA,
// max/min, NaN flags), and Vec<T>, the widest of the build. Included inside
// `namespace needle::<isa>` by kernels_impl.h; empty in the baseline build.
#if defined(__AVX2__) && defined(__FMA__)
template <class T> struct V256;  // 256-bit vectors with masked edge access (AVX2)
template <class T> struct V512;  // 512-bit vectors with masked edge access (AVX-512)
#if defined(__AVX512F__)
template <> struct V512<float> {
  using T = float;
  using V = __m512;
  using M = __mmask16;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_load_ps(p); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  using NanFlags = __mmask16;
  static NanFlags no_nan() { return 0; }
  static NanFlags flag_nan(NanFlags f, V x) { return f | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
  static bool any_nan(NanFlags f) { return f != 0; }
  static V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static M mask(int n) { return M(n >= W ? 0xffffu : (1u << n) - 1u); }
  static V load_mask(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_mask(float* p, V v, M m) { _mm512_mask_storeu_ps(p, m, v); }
};
template <> struct V512<double> {
  using T = double;
  using V = __m512d;
  using M = __mmask8;
  static constexpr int W = 8;
  static V zero() { return _mm512_setzero_pd(); }
  static V load(const double* p) { return _mm512_load_pd(p); }
  static V loadu(const double* p) { return _mm512_loadu_pd(p); }
  static void storeu(double* p, V v) { _mm512_storeu_pd(p, v); }
  static V set1(double v) { return _mm512_set1_pd(v); }
  static V max(V a, V b) { return _mm512_max_pd(a, b); }
  static V min(V a, V b) { return _mm512_min_pd(a, b); }
  using NanFlags = __mmask8;
  static NanFlags no_nan() { return 0; }
  static NanFlags flag_nan(NanFlags f, V x) { return f | _mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q); }
  static bool any_nan(NanFlags f) { return f != 0; }
  static V bcast(const double* p) { return _mm512_set1_pd(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static M mask(int n) { return M(n >= W ? 0xffu : (1u << n) - 1u); }
  static V load_mask(const double* p, M m) { return _mm512_maskz_loadu_pd(m, p); }
  static void store_mask(double* p, V v, M m) { _mm512_mask_storeu_pd(p, m, v); }
};
#endif
template <> struct V256<float> {
  using T = float;
  using V = __m256;
  using M = __m256i;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  using NanFlags = __m256;
  static NanFlags no_nan() { return _mm256_setzero_ps(); }
  static NanFlags flag_nan(NanFlags f, V x) { return _mm256_or_ps(f, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
  static bool any_nan(NanFlags f) { return _mm256_movemask_ps(f) != 0; }
  static V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static M mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load_mask(const float* p, M m) { return _mm256_maskload_ps(p, m); }
  static void store_mask(float* p, V v, M m) { _mm256_maskstore_ps(p, m, v); }
};
template <> struct V256<double> {
  using T = double;
  using V = __m256d;
  using M = __m256i;
  static constexpr int W = 4;
  static V zero() { return _mm256_setzero_pd(); }
  static V load(const double* p) { return _mm256_load_pd(p); }
  static V loadu(const double* p) { return _mm256_loadu_pd(p); }
  static void storeu(double* p, V v) { _mm256_storeu_pd(p, v); }
  static V set1(double v) { return _mm256_set1_pd(v); }
  static V max(V a, V b) { return _mm256_max_pd(a, b); }
  static V min(V a, V b) { return _mm256_min_pd(a, b); }
  using NanFlags = __m256d;
  static NanFlags no_nan() { return _mm256_setzero_pd(); }
  static NanFlags flag_nan(NanFlags f, V x) { return _mm256_or_pd(f, _mm256_cmp_pd(x, x, _CMP_UNORD_Q)); }
  static bool any_nan(NanFlags f) { return _mm256_movemask_pd(f) != 0; }
  static V bcast(const double* p) { return _mm256_broadcast_sd(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static M mask(int n) {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
  }
  static V load_mask(const double* p, M m) { return _mm256_maskload_pd(p, m); }
  static void store_mask(double* p, V v, M m) { _mm256_maskstore_pd(p, m, v); }
};
// The widest vector of this build.
#if defined(__AVX512F__)
template <class T> using Vec = V512<T>;
#else
template <class T> using Vec = V256<T>;
#endif
#endif
