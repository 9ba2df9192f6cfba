// float32 exp / tanh / sigmoid sixteen at a time (AVX-512 build). Included by
// elementwise_impl.h inside `namespace needle::avx512`; same algorithms as the 8-wide AVX2
// versions there, with two AVX-512 instructions doing what takes several in AVX2:
// `vscalefps` multiplies by 2^k with correct overflow, underflow and subnormal results, and
// `vrcp14ps` plus one Newton step (relative error ~2^-28) replaces the division (a zmm divide
// takes 10-16 cycles, the reciprocal 2-4 plus two FMAs).
#if defined(__AVX512F__)

// exp(r) for the reduced argument r = x - k ln2, and k (as a float).
inline __m512 exp16_reduced(__m512 xc, __m512* k_out) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(kExpPoly[6]);
  for (int j = 5; j >= 0; --j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[j]));
  *k_out = k;
  return p;
}

inline __m512 exp16(__m512 x) {
  // min/max return their second operand for NaN, so NaN flows through the clamp; below -104
  // the result is 0 and above 89 inf either way (scalef rounds / overflows correctly).
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-104.0f),
                                  _mm512_min_ps(_mm512_set1_ps(89.0f), x));
  __m512 k;
  const __m512 p = exp16_reduced(xc, &k);
  return _mm512_scalef_ps(p, k);
}

// 1 / d for d in [1, 2] (no zero, inf or NaN reaches it except NaN lanes, which stay NaN).
inline __m512 recip16(__m512 d) {
  const __m512 y0 = _mm512_rcp14_ps(d);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(d, y0, _mm512_set1_ps(1.0f)), y0, y0);
}

// tanh as tanh8 (elementwise_impl.h): -sign(x) E / (2 + E), E = expm1(-2|x|).
inline __m512 tanh16(__m512 x) {
  // NaN stays NaN through the clamp (max returns its second operand for NaN); past |x| = 20
  // E rounds to -1 and tanh to +-1 anyway.
  const __m512 y = _mm512_max_ps(_mm512_set1_ps(-40.0f),
                                 _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.0f)));
  const __m512 magic = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23: adding it rounds to integer
  const __m512 k = _mm512_sub_ps(
      _mm512_fmadd_ps(y, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), y);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 h = _mm512_set1_ps(kExpm1Poly[5]);
  for (int j = 4; j >= 0; --j) h = _mm512_fmadd_ps(h, r, _mm512_set1_ps(kExpm1Poly[j]));
  const __m512 em1_r = _mm512_fmadd_ps(_mm512_mul_ps(r, r), h, r);  // expm1(r)
  // expm1(y) = 2^k expm1(r) + (2^k - 1): exact for k = 0, one rounding otherwise
  const __m512 p2 = _mm512_scalef_ps(_mm512_set1_ps(1.0f), k);
  const __m512 e = _mm512_fmadd_ps(p2, em1_r, _mm512_sub_ps(p2, _mm512_set1_ps(1.0f)));
  const __m512 t = _mm512_mul_ps(e, recip16(_mm512_add_ps(e, _mm512_set1_ps(2.0f))));  // -|tanh|
  // result = t with its sign flipped where x >= 0: t XOR (NOT x AND sign bit), one instruction
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
      _mm512_castps_si512(t), _mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u)), 0xd2));
}

// 1 / (1 + exp(-x)) as 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, e = exp(-|x|): the
// denominator stays in [1, 2] and small results keep their relative accuracy.
inline __m512 sigmoid16(__m512 x) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 r = recip16(_mm512_add_ps(_mm512_set1_ps(1.0f), e));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_mul_ps(r, negative, r, e);
}

// Applies fn to whole vectors, tail included (masked); returns the elements done (all).
template <class Fn>
inline std::size_t vec16_loop(const float* a, float* out, std::size_t n, Fn fn) {
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {  // two independent chains per iteration
    const __m512 y0 = fn(_mm512_loadu_ps(a + i)), y1 = fn(_mm512_loadu_ps(a + i + 16));
    _mm512_storeu_ps(out + i, y0);
    _mm512_storeu_ps(out + i + 16, y1);
  }
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, fn(_mm512_loadu_ps(a + i)));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(out + i, m, fn(_mm512_maskz_loadu_ps(m, a + i)));
  }
  return n;
}
#endif
