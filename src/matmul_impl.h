// Packed, register-blocked matrix multiply (the BLIS loop structure).
// Included inside `namespace needle::<isa>` (see elementwise_impl.h).
//
//   for jc (NC columns of B/C)            B block kc x nc packed once, shared by all threads
//     for pc (KC of the inner dimension)
//       for each (ic block, jr range)      work items split across the OpenMP team
//         pack A block mc x kc             per thread, stays in L2
//         for jr (NR-column panels)        B micro-panel stays in L1
//           for ir (MR-row panels)         micro-kernel: MR x NR accumulators in registers
//
// The AVX2 build uses 6x16 (float32) and 6x8 (float64) FMA intrinsic micro-kernels; the
// baseline build a portable C++ micro-kernel the compiler vectorises. float16 is converted to
// float32, multiplied, rounded.

// A reusable per-thread scratch block (thread_local, so OpenMP workers keep theirs between
// calls and small matmuls do not pay a fresh allocation and its page faults every time).
struct Scratch {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  ~Scratch() { needle_free(ptr); }
  template <class T> T* get(std::size_t count) {
    if (count * sizeof(T) > bytes) {
      needle_free(ptr);
      ptr = nullptr;
      bytes = 0;
      ptr = needle_alloc(count * sizeof(T));
      bytes = count * sizeof(T);
    }
    return static_cast<T*>(ptr);
  }
};
inline thread_local Scratch tls_pack_a;
inline thread_local Scratch tls_pack_b;

inline std::size_t min_size(std::size_t a, std::size_t b) { return a < b ? a : b; }
inline std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

// A rows [0, rows) x cols [0, k) -> panels of MR rows, each stored k-major (MR values per k).
// A is strided: element (i, kk) at a[i * rs + kk * cs] (cs == 1 for a compact matrix).
template <class T, int MR>
void pack_a(const T* a, std::ptrdiff_t rs, std::ptrdiff_t cs, std::size_t rows, std::size_t k,
            T* dst) {
  for (std::size_t i0 = 0; i0 < rows; i0 += MR, dst += MR * k) {
    const std::size_t mr = min_size(MR, rows - i0);
    for (std::size_t r = 0; r < std::size_t(MR); ++r) {
      if (r < mr) {
        const T* src = a + std::ptrdiff_t(i0 + r) * rs;
        if (cs == 1) {
          for (std::size_t kk = 0; kk < k; ++kk) dst[kk * MR + r] = src[kk];
        } else {
          for (std::size_t kk = 0; kk < k; ++kk) dst[kk * MR + r] = src[std::ptrdiff_t(kk) * cs];
        }
      } else {
        for (std::size_t kk = 0; kk < k; ++kk) dst[kk * MR + r] = T(0);
      }
    }
  }
}

// One NR-column panel of B rows [0, k): NR values per k, zero padded past `cols`.
// B is strided: element (kk, c) at b[kk * rs + c * cs].
template <class T, int NR>
void pack_b_panel(const T* b, std::ptrdiff_t rs, std::ptrdiff_t cs, std::size_t k,
                  std::size_t cols, T* dst) {
  for (std::size_t kk = 0; kk < k; ++kk, dst += NR) {
    const T* src = b + std::ptrdiff_t(kk) * rs;
    std::size_t c = 0;
    if (cs == 1) {
      for (; c < cols; ++c) dst[c] = src[c];
    } else {
      for (; c < cols; ++c) dst[c] = src[std::ptrdiff_t(c) * cs];
    }
    for (; c < std::size_t(NR); ++c) dst[c] = T(0);
  }
}

// Portable micro-kernel: c (MR x NR, leading dimension ldc) = or += ap-panel @ bp-panel.
template <class T, int MR, int NR>
void micro_portable(std::size_t k, const T* ap, const T* bp, T* c, std::size_t ldc, bool acc) {
  T sum[MR][NR] = {};
  for (std::size_t kk = 0; kk < k; ++kk, ap += MR, bp += NR) {
    for (int r = 0; r < MR; ++r) {
      const T av = ap[r];
#pragma omp simd
      for (int j = 0; j < NR; ++j) sum[r][j] += av * bp[j];
    }
  }
  for (int r = 0; r < MR; ++r) {
    T* row = c + r * ldc;
    if (acc) {
      for (int j = 0; j < NR; ++j) row[j] += sum[r][j];
    } else {
      for (int j = 0; j < NR; ++j) row[j] = sum[r][j];
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 6x16 float32 micro-kernel: 12 ymm accumulators, 2 for the B row, 1 broadcast of A.
inline void micro_avx2_6x16(std::size_t k, const float* ap, const float* bp, float* c,
                            std::size_t ldc, bool acc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (std::size_t kk = 0; kk < k; ++kk, ap += 6, bp += 16) {
    const __m256 b0 = _mm256_load_ps(bp);
    const __m256 b1 = _mm256_load_ps(bp + 8);
    __m256 a = _mm256_broadcast_ss(ap + 0);
    c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
    a = _mm256_broadcast_ss(ap + 1);
    c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
    a = _mm256_broadcast_ss(ap + 2);
    c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
    a = _mm256_broadcast_ss(ap + 3);
    c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
    a = _mm256_broadcast_ss(ap + 4);
    c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
    a = _mm256_broadcast_ss(ap + 5);
    c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
  }
  const __m256 rows[6][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                             {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < 6; ++r) {
    float* row = c + r * ldc;
    __m256 lo = rows[r][0], hi = rows[r][1];
    if (acc) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(row));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(row + 8));
    }
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 6x8 float64 micro-kernel: the same register plan with 4-lane vectors.
inline void micro_avx2_6x8d(std::size_t k, const double* ap, const double* bp, double* c,
                            std::size_t ldc, bool acc) {
  __m256d acc_lo[6], acc_hi[6];
  for (int r = 0; r < 6; ++r) acc_lo[r] = acc_hi[r] = _mm256_setzero_pd();
#pragma GCC unroll 4
  for (std::size_t kk = 0; kk < k; ++kk, ap += 6, bp += 8) {
    const __m256d b0 = _mm256_load_pd(bp);
    const __m256d b1 = _mm256_load_pd(bp + 4);
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      const __m256d a = _mm256_broadcast_sd(ap + r);
      acc_lo[r] = _mm256_fmadd_pd(a, b0, acc_lo[r]);
      acc_hi[r] = _mm256_fmadd_pd(a, b1, acc_hi[r]);
    }
  }
  for (int r = 0; r < 6; ++r) {
    double* row = c + r * ldc;
    __m256d lo = acc_lo[r], hi = acc_hi[r];
    if (acc) {
      lo = _mm256_add_pd(lo, _mm256_loadu_pd(row));
      hi = _mm256_add_pd(hi, _mm256_loadu_pd(row + 4));
    }
    _mm256_storeu_pd(row, lo);
    _mm256_storeu_pd(row + 4, hi);
  }
}
#endif

template <class T> struct GemmConfig {  // portable kernel, float64 and baseline float32
  static constexpr int MR = 4, NR = 8;
  static constexpr std::size_t KC = 256, MC = 96, NC = 2048;
  static void kernel(std::size_t k, const T* ap, const T* bp, T* c, std::size_t ldc, bool acc) {
    micro_portable<T, MR, NR>(k, ap, bp, c, ldc, acc);
  }
};
#if defined(__AVX2__) && defined(__FMA__)
#ifndef NEEDLE_SGEMM_KC  // blocking of the float32 kernel; overridable for tuning experiments
#define NEEDLE_SGEMM_KC 256
#define NEEDLE_SGEMM_MC 144
#define NEEDLE_SGEMM_NC 3072
#endif
template <> struct GemmConfig<float> {
  static constexpr int MR = 6, NR = 16;
  static constexpr std::size_t KC = NEEDLE_SGEMM_KC, MC = NEEDLE_SGEMM_MC, NC = NEEDLE_SGEMM_NC;
  static void kernel(std::size_t k, const float* ap, const float* bp, float* c,
                     std::size_t ldc, bool acc) {
    micro_avx2_6x16(k, ap, bp, c, ldc, acc);
  }
};
template <> struct GemmConfig<double> {
  static constexpr int MR = 6, NR = 8;
  static constexpr std::size_t KC = 256, MC = 96, NC = 2048;
  static void kernel(std::size_t k, const double* ap, const double* bp, double* c,
                     std::size_t ldc, bool acc) {
    micro_avx2_6x8d(k, ap, bp, c, ldc, acc);
  }
};
#endif

// Runs the micro-kernel on a tile that may be cut by the edge of C (mr <= MR, nr <= NR).
template <class T>
inline void tile(std::size_t k, const T* ap, const T* bp, T* c, std::size_t ldc,
                 std::size_t mr, std::size_t nr, bool acc) {
  using G = GemmConfig<T>;
  if (mr == std::size_t(G::MR) && nr == std::size_t(G::NR)) {
    return G::kernel(k, ap, bp, c, ldc, acc);
  }
  alignas(64) T tmp[G::MR * G::NR];
  G::kernel(k, ap, bp, tmp, G::NR, false);
  for (std::size_t r = 0; r < mr; ++r)
    for (std::size_t j = 0; j < nr; ++j)
      c[r * ldc + j] = acc ? c[r * ldc + j] + tmp[r * G::NR + j] : tmp[r * G::NR + j];
}

// One function for the whole loop nest (longer than our usual 40 lines) because the OpenMP
// region must enclose every loop: a region per block would fork and join thousands of times.
// a(i, k) = a[i * ars + k * acs], b(k, j) = b[k * brs + j * bcs]; c is compact m x p. Packing
// reads any strides, so transposed or sliced operands need no compact copy first.
template <class T>
void gemm(const T* a, std::ptrdiff_t ars, std::ptrdiff_t acs, const T* b, std::ptrdiff_t brs,
          std::ptrdiff_t bcs, T* c, std::size_t m, std::size_t n, std::size_t p) {
  using G = GemmConfig<T>;
  constexpr std::size_t MR = G::MR, NR = G::NR;
  if (m == 0 || p == 0) return;
  if (n == 0) { std::memset(c, 0, m * p * sizeof(T)); return; }
  const double flops = 2.0 * double(m) * double(n) * double(p);
  const int nt = flops >= kParallelMinFlops ? num_threads() : 1;
  // Row blocks: a multiple of the thread count when that fits, so the static split is even.
  const std::size_t ic_blocks = std::size_t(nt) * ceil_div(m, std::size_t(nt) * G::MC);
  const std::size_t mc = min_size(G::MC, ceil_div(ceil_div(m, ic_blocks), MR) * MR);
  const std::size_t n_ic = ceil_div(m, mc);
  const std::size_t nc_max = min_size(G::NC, ceil_div(p, NR) * NR);
  const std::size_t kc_max = min_size(G::KC, n);
  T* bpack = tls_pack_b.get<T>(kc_max * nc_max);

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    T* apack = tls_pack_a.get<T>(kc_max * ceil_div(mc, MR) * MR);
    std::size_t packed_ic = ~std::size_t(0), packed_pc = ~std::size_t(0);
    for (std::size_t jc = 0; jc < p; jc += G::NC) {
      const std::size_t nc = min_size(G::NC, p - jc);
      const std::size_t panels = ceil_div(nc, NR);
      // With fewer row blocks than threads, each row block's panels are split further.
      const std::size_t jr_parts =
          n_ic >= std::size_t(nt) ? 1 : min_size(panels, ceil_div(nt, n_ic));
      for (std::size_t pc = 0; pc < n; pc += G::KC) {
        const std::size_t kc = min_size(G::KC, n - pc);
#pragma omp for schedule(static)
        for (std::size_t jp = 0; jp < panels; ++jp) {
          const std::size_t j0 = jp * NR;
          pack_b_panel<T, NR>(b + std::ptrdiff_t(pc) * brs + std::ptrdiff_t(jc + j0) * bcs,
                              brs, bcs, kc, min_size(NR, nc - j0), bpack + jp * NR * kc);
        }
#pragma omp for schedule(static)
        for (std::size_t item = 0; item < n_ic * jr_parts; ++item) {
          const std::size_t ib = item / jr_parts, part = item % jr_parts;
          const std::size_t ic = ib * mc, mcur = min_size(mc, m - ic);
          if (packed_ic != ic || packed_pc != pc) {
            pack_a<T, MR>(a + std::ptrdiff_t(ic) * ars + std::ptrdiff_t(pc) * acs, ars, acs,
                          mcur, kc, apack);
            packed_ic = ic;
            packed_pc = pc;
          }
          const std::size_t jp0 = panels * part / jr_parts, jp1 = panels * (part + 1) / jr_parts;
          for (std::size_t jp = jp0; jp < jp1; ++jp) {
            const std::size_t j0 = jp * NR, nr = min_size(NR, nc - j0);
            for (std::size_t i0 = 0; i0 < mcur; i0 += MR) {
              tile<T>(kc, apack + i0 * kc, bpack + jp * NR * kc, c + (ic + i0) * p + jc + j0, p,
                      min_size(MR, mcur - i0), nr, pc > 0);
            }
          }
        }
      }
    }
  }
}

void matmul(DType t, const void* a, const void* b, void* out, std::size_t m, std::size_t n,
            std::size_t p) {
  const auto ni = std::ptrdiff_t(n), pi = std::ptrdiff_t(p);
  if (t == DType::f32) {
    return gemm(static_cast<const float*>(a), ni, 1, static_cast<const float*>(b), pi, 1,
                static_cast<float*>(out), m, n, p);
  }
  if (t == DType::f64) {
    return gemm(static_cast<const double*>(a), ni, 1, static_cast<const double*>(b), pi, 1,
                static_cast<double*>(out), m, n, p);
  }
  // float16: widen both operands, multiply in float32, round the result once.
  float* af = static_cast<float*>(needle_alloc((m * n + n * p + m * p) * sizeof(float)));
  float* bf = af + m * n;
  float* cf = bf + n * p;
  try {
    cast(DType::f16, a, DType::f32, af, m * n);
    cast(DType::f16, b, DType::f32, bf, n * p);
    gemm(af, std::ptrdiff_t(n), 1, bf, std::ptrdiff_t(p), 1, cf, m, n, p);
    cast(DType::f32, cf, DType::f16, out, m * p);
  } catch (...) {
    needle_free(af);
    throw;
  }
  needle_free(af);
}

// out(m x p) = A @ B for strided float32/float64 operands (see gemm); float16 callers compact.
void matmul_strided(DType t, const void* a, std::ptrdiff_t ars, std::ptrdiff_t acs,
                    const void* b, std::ptrdiff_t brs, std::ptrdiff_t bcs, void* out,
                    std::size_t m, std::size_t n, std::size_t p) {
  if (t == DType::f32) {
    return gemm(static_cast<const float*>(a), ars, acs, static_cast<const float*>(b), brs, bcs,
                static_cast<float*>(out), m, n, p);
  }
  if (t == DType::f64) {
    return gemm(static_cast<const double*>(a), ars, acs, static_cast<const double*>(b), brs,
                bcs, static_cast<double*>(out), m, n, p);
  }
  throw std::invalid_argument("matmul_strided: expected float32 or float64, got float16");
}
