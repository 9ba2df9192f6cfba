// Elementwise kernels. Included by kernels_base.cc and kernels_avx2.cc inside
// `namespace needle::<isa>`, so every helper here exists once per instruction set and the
// linker can never mix an AVX2 copy into the baseline path.
//
// float32 and float64 run the loops directly; float16 and bfloat16 are converted block by
// block into float32 scratch on the stack, computed in float32 and rounded back (round to
// nearest even).

// ---- bit casts and float16 blocks ----------------------------------------------------------

inline std::int32_t float_bits(float f) { std::int32_t i; std::memcpy(&i, &f, 4); return i; }
inline float bits_float(std::int32_t i) { float f; std::memcpy(&f, &i, 4); return f; }

inline void load_half(const half_bits* src, float* dst, std::size_t n) {
  std::size_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
#else
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
#endif
}

inline void store_half(const float* src, half_bits* dst, std::size_t n) {
  std::size_t i = 0;
#ifdef __F16C__
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], kRound);
#else
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
#endif
}

// bfloat16 is the top half of a float32: widening is a shift, narrowing rounds to nearest even
// (float_to_bf16); plain loops the compiler vectorises.
inline void load_bf16(const bf16_bits* src, float* dst, std::size_t n) {
#pragma omp simd
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = bits_float(std::int32_t(std::uint32_t(src[i]) << 16));
}

inline void store_bf16(const float* src, bf16_bits* dst, std::size_t n) {
#pragma omp simd
  for (std::size_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// Widens n two-byte elements of dtype t (float16 or bfloat16) to float32, and back.
inline void load_small(DType t, const std::uint16_t* src, float* dst, std::size_t n) {
  if (t == DType::bf16) load_bf16(src, dst, n); else load_half(src, dst, n);
}
inline void store_small(DType t, const float* src, std::uint16_t* dst, std::size_t n) {
  if (t == DType::bf16) store_bf16(src, dst, n); else store_half(src, dst, n);
}

// Elements per float16 scratch block: three blocks of floats stay well inside L1.
constexpr std::size_t kHalfBlock = 512;

// Runs `body(float* const* in, float* out, n)` over float16 or bfloat16 (t) arrays block by
// block.
template <int NIn, class Body>
void half_blocks(DType t, const half_bits* const* in, half_bits* out, std::size_t n,
                 Body&& body) {
  alignas(64) float buf[NIn + 1][kHalfBlock];
  for (std::size_t s = 0; s < n; s += kHalfBlock) {
    const std::size_t len = n - s < kHalfBlock ? n - s : kHalfBlock;
    float* ins[NIn > 0 ? NIn : 1];
    for (int k = 0; k < NIn; ++k) { load_small(t, in[k] + s, buf[k], len); ins[k] = buf[k]; }
    body(static_cast<float* const*>(ins), buf[NIn], len);
    store_small(t, buf[NIn], out + s, len);
  }
}

// ---- fast float32 exp / tanh ---------------------------------------------------------------

// exp(x) = 2^k * exp(r), k = round(x / ln 2), |r| <= ln2 / 2; exp(r) by a degree-6
// polynomial (least-squares fit in float64 on Chebyshev nodes, relative error 2.5e-9);
// 2^k applied in two halves so results down into the subnormal range come out right. Max error
// ~1.5 ulp against the correctly rounded value; NaN and +-inf behave as std::exp. Branch-free
// so that `omp simd` vectorises it.
constexpr float kExpPoly[7] = {0.9999999999593863f, 1.0000000378408955f, 0.5000000108073382f,
                               0.16666414973758578f, 0.0416662173757871f, 0.00837517078637942f,
                               0.0013948640637775592f};
inline float fast_expf(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + magic;
  const float k = t - magic;
  const std::int32_t ki = float_bits(t) - float_bits(magic);
  const float r = (xc - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  float p = kExpPoly[6];
  for (int j = 5; j >= 0; --j) p = p * r + kExpPoly[j];
  const std::int32_t k1 = ki >> 1;
  const float y = p * bits_float((k1 + 127) << 23) * bits_float((ki - k1 + 127) << 23);
  const float inf = bits_float(0x7f800000);
  return x != x ? x : (x > 88.72283935546875f ? inf : y);
}

// tanh: an odd polynomial fitted (least squares in float64, 0.78 ulp max in float32) below
// |x| = 0.625, where (1 - e) / (1 + e) with e = exp(-2|x|) would cancel; that formula above.
inline float fast_tanhf(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float y = x * x;
  float q = 0.002295607700943947f;
  q = q * y - 0.008346729911863804f;
  q = q * y + 0.02176986262202263f;
  q = q * y - 0.05395938828587532f;
  q = q * y + 0.13333304226398468f;
  q = q * y - 0.3333333432674408f;
  const float small = x + x * y * q;
  const float e = fast_expf(-2.0f * ax);
  const float big = (1.0f - e) / (1.0f + e);
  const float large = x < 0.0f ? -big : big;
  return x != x ? x : (ax < 0.625f ? small : large);
}

#if defined(__AVX2__) && defined(__FMA__)
// The same algorithms written with intrinsics, eight floats at a time: the auto-vectorised
// versions spill their constants and lose ~2x to register pressure.
// exp(r) for the reduced argument and the power of two k, with x = k ln2 + r.
inline __m256 exp8_reduced(__m256 xc, __m256i* k_out) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 k = _mm256_sub_ps(t, magic);
  const __m256i ki = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), xc);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(kExpPoly[6]);
  for (int j = 5; j >= 0; --j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[j]));
  *k_out = ki;
  return p;
}

// 2^k as a float for -126 <= k <= 127.
inline __m256 pow2_8(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

inline __m256 exp8_core(__m256 xc) {  // xc already clamped to [-104, 89]
  __m256i k;
  const __m256 p = exp8_reduced(xc, &k);
  const __m256i k1 = _mm256_srai_epi32(k, 1);  // 2^k in two halves: k may reach -150 or 128
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(k1)), pow2_8(_mm256_sub_epi32(k, k1)));
}

inline __m256 exp8(__m256 x) {
  // max/min return their second operand for NaN: NaN lanes are patched at the end.
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
  __m256 y = exp8_core(xc);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(HUGE_VALF),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// 1 / d for d in [1, 2]: the 12-bit reciprocal and one Newton step (~23 bits), cheaper than a
// division.
inline __m256 recip8(__m256 d) {
  const __m256 y0 = _mm256_rcp_ps(d);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(d, y0, _mm256_set1_ps(1.0f)), y0, y0);
}

// expm1(r) = r + r^2 h(r) on |r| <= ln2 / 2, h of degree 5 (least squares on Chebyshev nodes
// in float64, relative to expm1; 0.82 ulp max in float32).
constexpr float kExpm1Poly[6] = {0.5f, 0.1666666567325592f, 0.04166635498404503f,
                                 0.008333378471434116f, 0.0013941085198894143f,
                                 0.00019851612159982324f};

// tanh(x) = -sign(x) E / (2 + E) with E = expm1(-2|x|) in (-1, 0]: one exp-like evaluation,
// no cancellation near 0 (E ~ -2|x| keeps its relative accuracy), a denominator in (1, 2].
// NaN in, NaN out (max returns its second operand for NaN); past |x| = 20 E rounds to -1.
inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 y = _mm256_max_ps(_mm256_set1_ps(-40.0f),
                                 _mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.0f)));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 t = _mm256_fmadd_ps(y, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 k = _mm256_sub_ps(t, magic);
  const __m256i ki = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), y);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 h = _mm256_set1_ps(kExpm1Poly[5]);
  for (int j = 4; j >= 0; --j) h = _mm256_fmadd_ps(h, r, _mm256_set1_ps(kExpm1Poly[j]));
  const __m256 em1_r = _mm256_fmadd_ps(_mm256_mul_ps(r, r), h, r);
  // expm1(y) = 2^k expm1(r) + (2^k - 1): exact for k = 0; k >= -58 here
  const __m256 p2 = pow2_8(ki);
  const __m256 e = _mm256_fmadd_ps(p2, em1_r, _mm256_sub_ps(p2, _mm256_set1_ps(1.0f)));
  const __m256 neg = _mm256_mul_ps(e, recip8(_mm256_add_ps(e, _mm256_set1_ps(2.0f))));
  return _mm256_xor_ps(neg, _mm256_andnot_ps(x, sign));  // flip to positive where x >= 0
}

// 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, e = exp(-|x|): the denominator stays in
// [1, 2] (no overflow to handle) and small results keep their relative accuracy.
inline __m256 sigmoid8(__m256 x) {
  const __m256 e = exp8(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));  // exp(-|x|)
  const __m256 r = recip8(_mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_blendv_ps(r, _mm256_mul_ps(r, e), x);  // blend on x's sign bit
}

// Applies fn to whole vectors, leaving the tail to `scalar`; returns the elements done.
template <class Fn>
inline std::size_t vec8_loop(const float* a, float* out, std::size_t n, Fn fn) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, fn(_mm256_loadu_ps(a + i)));
  return i;
}
#endif

#include "elementwise_avx512_impl.h"

// ---- element functions ---------------------------------------------------------------------

template <class T> inline T op_exp(T x) { return std::exp(x); }
template <> inline float op_exp<float>(float x) { return fast_expf(x); }
template <class T> inline T op_tanh(T x) { return std::tanh(x); }
template <> inline float op_tanh<float>(float x) { return fast_tanhf(x); }

template <BinOp OP, class T>
inline T apply_bin(T a, T b) {
  if constexpr (OP == BinOp::add) return a + b;
  if constexpr (OP == BinOp::sub) return a - b;
  if constexpr (OP == BinOp::mul) return a * b;
  if constexpr (OP == BinOp::div) return a / b;
  // NaN in either operand propagates, as in NumPy.
  if constexpr (OP == BinOp::maximum) return (a > b || a != a) ? a : b;
  if constexpr (OP == BinOp::minimum) return (a < b || a != a) ? a : b;
  if constexpr (OP == BinOp::power) return std::pow(a, b);
  if constexpr (OP == BinOp::eq) return a == b ? T(1) : T(0);
  if constexpr (OP == BinOp::ge) return a >= b ? T(1) : T(0);
  // rounded as the composed kernels round (t*t, then 1 - that, then g * that)
  if constexpr (OP == BinOp::tanh_grad) {
    const T square = b * b;
    const T slope = T(1) - square;
    return a * slope;
  }
  if constexpr (OP == BinOp::relu_grad) return a * (b > T(0) ? T(1) : (b < T(0) ? T(-1) : b));
}

template <UnOp OP, class T>
inline T apply_un(T x) {
  if constexpr (OP == UnOp::neg) return -x;
  if constexpr (OP == UnOp::log) return std::log(x);
  if constexpr (OP == UnOp::exp) return op_exp(x);
  if constexpr (OP == UnOp::tanh) return op_tanh(x);
  if constexpr (OP == UnOp::sqrt) return std::sqrt(x);
  if constexpr (OP == UnOp::abs) return std::abs(x);
  if constexpr (OP == UnOp::sign) return x > T(0) ? T(1) : (x < T(0) ? T(-1) : x);
  if constexpr (OP == UnOp::sigmoid) return T(1) / (T(1) + op_exp(-x));
}

inline bool is_heavy_un(UnOp op) {
  return op == UnOp::log || op == UnOp::exp || op == UnOp::tanh || op == UnOp::sigmoid;
}

// ---- loops over compact arrays -------------------------------------------------------------

// Outputs at least this large are written with non-temporal (streaming) stores: they cannot
// stay in cache anyway, and a normal store first reads the line it writes (the 4th stream of
// an a + b -> out loop). NumPy writes normally, so this is where a DRAM-bound add beats it.
constexpr std::size_t kStreamMinBytes = std::size_t(16) << 20;

// Runs fn(dst, offset, len) over [0, n) in L1-sized blocks computed into a buffer and streamed
// to out; returns false (nothing done) when the output is too small or the build has no
// streaming stores.
template <class T, class Fn>
inline bool streamed(T* out, std::size_t n, Fn&& fn) {
#if defined(__AVX2__)
  if (n * sizeof(T) < kStreamMinBytes) return false;
  constexpr std::size_t kBlock = 4096 / sizeof(T) * 2, kLine = 64 / sizeof(T);
  alignas(64) T tmp[kBlock];
  const std::size_t misaligned = (reinterpret_cast<std::uintptr_t>(out) % 64) / sizeof(T);
  std::size_t i = misaligned ? kLine - misaligned : 0;
  if (i) fn(out, 0, i);
  for (; i + kBlock <= n; i += kBlock) {
    fn(tmp, i, kBlock);
    for (std::size_t j = 0; j < kBlock; j += 32 / sizeof(T)) {
      if constexpr (std::is_same_v<T, float>) {
        _mm256_stream_ps(out + i + j, _mm256_load_ps(tmp + j));
      } else {
        _mm256_stream_pd(out + i + j, _mm256_load_pd(tmp + j));
      }
    }
  }
  if (i < n) fn(out + i, i, n - i);
  _mm_sfence();
  return true;
#else
  (void)out; (void)n; (void)fn;
  return false;
#endif
}

template <BinOp OP, class T>
void bin_loop_plain(const T* a, const T* b, T* out, std::size_t n) {
#pragma omp simd
  for (std::size_t i = 0; i < n; ++i) out[i] = apply_bin<OP, T>(a[i], b[i]);
}

template <BinOp OP, class T>
void bin_loop(const T* a, const T* b, T* out, std::size_t n) {
  if (streamed(out, n, [&](T* dst, std::size_t off, std::size_t len) {
        bin_loop_plain<OP>(a + off, b + off, dst, len);
      })) {
    return;
  }
  bin_loop_plain<OP>(a, b, out, n);
}

template <BinOp OP, class T>
void scalar_loop_plain(const T* a, T v, T* out, std::size_t n, bool reversed) {
  if (reversed) {
#pragma omp simd
    for (std::size_t i = 0; i < n; ++i) out[i] = apply_bin<OP, T>(v, a[i]);
  } else {
#pragma omp simd
    for (std::size_t i = 0; i < n; ++i) out[i] = apply_bin<OP, T>(a[i], v);
  }
}

template <BinOp OP, class T>
void scalar_loop(const T* a, T v, T* out, std::size_t n, bool reversed) {
  if (streamed(out, n, [&](T* dst, std::size_t off, std::size_t len) {
        scalar_loop_plain<OP>(a + off, v, dst, len, reversed);
      })) {
    return;
  }
  scalar_loop_plain<OP>(a, v, out, n, reversed);
}

template <UnOp OP, class T>
void un_loop_plain(const T* a, T* out, std::size_t n) {
  std::size_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && OP == UnOp::exp) i = vec16_loop(a, out, n, exp16);
  if constexpr (std::is_same_v<T, float> && OP == UnOp::tanh) i = vec16_loop(a, out, n, tanh16);
  if constexpr (std::is_same_v<T, float> && OP == UnOp::sigmoid) {
    i = vec16_loop(a, out, n, sigmoid16);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float> && OP == UnOp::exp) i = vec8_loop(a, out, n, exp8);
  if constexpr (std::is_same_v<T, float> && OP == UnOp::tanh) i = vec8_loop(a, out, n, tanh8);
  if constexpr (std::is_same_v<T, float> && OP == UnOp::sigmoid) i = vec8_loop(a, out, n, sigmoid8);
#endif
#pragma omp simd
  for (std::size_t j = i; j < n; ++j) out[j] = apply_un<OP, T>(a[j]);
}


template <UnOp OP, class T>
void un_loop(const T* a, T* out, std::size_t n) {
  if (streamed(out, n, [&](T* dst, std::size_t off, std::size_t len) {
        un_loop_plain<OP>(a + off, dst, len);
      })) {
    return;
  }
  un_loop_plain<OP>(a, out, n);
}

// ---- dtype dispatch ------------------------------------------------------------------------

template <BinOp OP>
void run_binary(DType t, const void* a, const void* b, void* out, std::size_t n) {
  const std::size_t th = OP == BinOp::power ? kParallelMinHeavyElements : kParallelMinElements;
  parallel_range(n, th, [&](std::size_t s, std::size_t e) {
    if (t == DType::f32) {
      bin_loop<OP>(static_cast<const float*>(a) + s, static_cast<const float*>(b) + s,
                   static_cast<float*>(out) + s, e - s);
    } else if (t == DType::f64) {
      bin_loop<OP>(static_cast<const double*>(a) + s, static_cast<const double*>(b) + s,
                   static_cast<double*>(out) + s, e - s);
    } else {
      const half_bits* in[2] = {static_cast<const half_bits*>(a) + s,
                                static_cast<const half_bits*>(b) + s};
      half_blocks<2>(t, in, static_cast<half_bits*>(out) + s, e - s,
                     [](float* const* x, float* o, std::size_t len) {
                       bin_loop<OP>(x[0], x[1], o, len);
                     });
    }
  });
}

template <BinOp OP>
void run_scalar(bool reversed, DType t, const void* a, double val, void* out, std::size_t n) {
  const std::size_t th = OP == BinOp::power ? kParallelMinHeavyElements : kParallelMinElements;
  // NumPy treats a Python scalar as the array's dtype: round it to float16/bfloat16 first.
  const float vh = t == DType::bf16 ? bf16_to_float(double_to_bf16(val))
                                    : half_to_float(double_to_half(val));
  parallel_range(n, th, [&](std::size_t s, std::size_t e) {
    if (t == DType::f32) {
      scalar_loop<OP>(static_cast<const float*>(a) + s, float(val),
                      static_cast<float*>(out) + s, e - s, reversed);
    } else if (t == DType::f64) {
      scalar_loop<OP>(static_cast<const double*>(a) + s, val, static_cast<double*>(out) + s,
                      e - s, reversed);
    } else {
      const half_bits* in[1] = {static_cast<const half_bits*>(a) + s};
      half_blocks<1>(t, in, static_cast<half_bits*>(out) + s, e - s,
                     [&](float* const* x, float* o, std::size_t len) {
                       scalar_loop<OP>(x[0], vh, o, len, reversed);
                     });
    }
  });
}

template <UnOp OP>
void run_unary(DType t, const void* a, void* out, std::size_t n) {
  const std::size_t th = is_heavy_un(OP) ? kParallelMinHeavyElements : kParallelMinElements;
  parallel_range(n, th, [&](std::size_t s, std::size_t e) {
    if (t == DType::f32) {
      un_loop<OP>(static_cast<const float*>(a) + s, static_cast<float*>(out) + s, e - s);
    } else if (t == DType::f64) {
      un_loop<OP>(static_cast<const double*>(a) + s, static_cast<double*>(out) + s, e - s);
    } else {
      const half_bits* in[1] = {static_cast<const half_bits*>(a) + s};
      half_blocks<1>(t, in, static_cast<half_bits*>(out) + s, e - s,
                     [](float* const* x, float* o, std::size_t len) {
                       un_loop<OP>(x[0], o, len);
                     });
    }
  });
}

#define NEEDLE_BIN_CASES(CALL) \
  CALL(add) CALL(sub) CALL(mul) CALL(div) CALL(maximum) CALL(minimum) CALL(power) CALL(eq) CALL(ge) \
  CALL(tanh_grad) CALL(relu_grad)

void binary(BinOp op, DType t, const void* a, const void* b, void* out, std::size_t n) {
  switch (op) {
#define NEEDLE_CASE(name) case BinOp::name: return run_binary<BinOp::name>(t, a, b, out, n);
    NEEDLE_BIN_CASES(NEEDLE_CASE)
#undef NEEDLE_CASE
  }
  throw std::invalid_argument("ewise: unknown binary op");
}

void scalar(BinOp op, bool reversed, DType t, const void* a, double val, void* out,
            std::size_t n) {
  switch (op) {
#define NEEDLE_CASE(name) \
  case BinOp::name: return run_scalar<BinOp::name>(reversed, t, a, val, out, n);
    NEEDLE_BIN_CASES(NEEDLE_CASE)
#undef NEEDLE_CASE
  }
  throw std::invalid_argument("scalar: unknown op");
}

void unary(UnOp op, DType t, const void* a, void* out, std::size_t n) {
  switch (op) {
#define NEEDLE_CASE(name) case UnOp::name: return run_unary<UnOp::name>(t, a, out, n);
    NEEDLE_CASE(neg) NEEDLE_CASE(log) NEEDLE_CASE(exp) NEEDLE_CASE(tanh) NEEDLE_CASE(sqrt)
    NEEDLE_CASE(abs) NEEDLE_CASE(sign) NEEDLE_CASE(sigmoid)
#undef NEEDLE_CASE
  }
  throw std::invalid_argument("ewise: unknown unary op");
}

// ---- casts ---------------------------------------------------------------------------------

template <class From, class To>
void cast_loop(const From* a, To* out, std::size_t n) {
#pragma omp simd
  for (std::size_t i = 0; i < n; ++i) out[i] = To(a[i]);
}

void cast_range(DType from, const void* a, DType to, void* out, std::size_t s, std::size_t e) {
  const std::size_t n = e - s;
  if (from == to) {
    std::memcpy(static_cast<char*>(out) + s * itemsize(to),
                static_cast<const char*>(a) + s * itemsize(from), n * itemsize(to));
    return;
  }
  const float* af = static_cast<const float*>(a) + s;
  const double* ad = static_cast<const double*>(a) + s;
  const half_bits* ah = static_cast<const half_bits*>(a) + s;
  float* of = static_cast<float*>(out) + s;
  double* od = static_cast<double*>(out) + s;
  half_bits* oh = static_cast<half_bits*>(out) + s;
  if (from == DType::f32 && to == DType::f64) return cast_loop(af, od, n);
  if (from == DType::f64 && to == DType::f32) return cast_loop(ad, of, n);
  if (is_low_precision(from) && to == DType::f32) return load_small(from, ah, of, n);
  if (from == DType::f32 && is_low_precision(to)) return store_small(to, af, oh, n);
  if (is_low_precision(from) && is_low_precision(to)) {  // through float32: exact widening
    alignas(64) float buf[kHalfBlock];
    for (std::size_t i = 0; i < n; i += kHalfBlock) {
      const std::size_t len = n - i < kHalfBlock ? n - i : kHalfBlock;
      load_small(from, ah + i, buf, len);
      store_small(to, buf, oh + i, len);
    }
    return;
  }
  if (from == DType::f16 && to == DType::f64) {
    for (std::size_t i = 0; i < n; ++i) od[i] = double(half_to_float(ah[i]));
    return;
  }
  if (from == DType::bf16 && to == DType::f64) {
    for (std::size_t i = 0; i < n; ++i) od[i] = double(bf16_to_float(ah[i]));
    return;
  }
  // float64 -> float16/bfloat16 rounds directly (through float32 it could round twice).
  if (to == DType::bf16) {
    for (std::size_t i = 0; i < n; ++i) oh[i] = double_to_bf16(ad[i]);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) oh[i] = double_to_half(ad[i]);
}

void cast(DType from, const void* a, DType to, void* out, std::size_t n) {
  parallel_range(n, kParallelMinElements,
                 [&](std::size_t s, std::size_t e) { cast_range(from, a, to, out, s, e); });
}
