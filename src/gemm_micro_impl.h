// Matmul micro-kernels and their blocking, one set per instruction set. Included inside
// `namespace needle::<isa>` by matmul_impl.h (after the packing helpers).
//
// A micro-kernel computes an MR x NR block of C from a packed A panel (MR values per k) and a
// B panel: either packed (NR values per k, 64-byte aligned) or read straight from a row-major
// B (`ldb` apart per k) when B is small enough that packing it costs more than it saves.
// The AVX2 and AVX-512 builds share one kernel template over a vector type: AVX2 uses 6 x 16
// float32 / 6 x 8 float64 tiles (12 ymm accumulators), AVX-512 12 x 32 / 12 x 16 (24 zmm).
// Edge tiles are stored with masks and computed by half-height / half-width variants when at
// most half full, so a 64 x 64 product does not pay for 72 rows. The baseline build uses a
// portable kernel the compiler vectorises.

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

// How a micro-kernel reads B: from the packed panel, or straight from B with every lane
// inside the matrix, or straight from B with masked loads (the last, partial panel).
enum class BRead { packed, direct, direct_masked };
// How it reads A: from packed panels (MRS values per k), or straight from a row-major A
// (rows `lda` apart) when C has a single column panel and packing would read A twice.
// `direct_edge` is the same for a tile cut by the bottom of C: rows past it re-read its last
// row, so that the kernel never reads outside A.
enum class ARead { packed, direct, direct_edge };

#if defined(__AVX2__) && defined(__FMA__)
// Computes MR rows and NV vectors per row of C (mr x nr of them are inside C). Packed A
// panels are MRS rows wide: MR < MRS reads the first rows of one panel (half height), MR =
// 2 MRS reads two consecutive panels (`k * MRS` apart) so that a one-vector-wide C still
// has enough accumulators. A packed B panel is NR wide (NV * W <= NR); a direct B is read
// `ldb` apart.
template <class Z, int MR, int MRS, int NR, int NV, ARead AR, BRead BR, class T = typename Z::T>
inline void micro_vec(std::size_t k, const T* ap, std::size_t lda, const T* bp, std::size_t ldb,
                      T* c, std::size_t ldc, std::size_t mr, std::size_t nr, bool acc) {
  const std::size_t second_panel = k * MRS;
  const std::size_t astep = AR == ARead::packed ? std::size_t(MRS) : 1;
  const std::size_t last_row = mr - 1;
  using V = typename Z::V;
  typename Z::M lanes[NV];  // lanes of each vector inside C (column edge)
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) lanes[v] = Z::mask(int(nr) - v * Z::W);
  const std::size_t bstep = BR == BRead::packed ? std::size_t(NR) : ldb;
  V sum[MR][NV];
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) sum[r][v] = Z::zero();
  }
#pragma GCC unroll 2
  for (std::size_t kk = 0; kk < k; ++kk, ap += astep, bp += bstep) {
    V b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if constexpr (BR == BRead::packed) b[v] = Z::load(bp + v * Z::W);
      else if constexpr (BR == BRead::direct) b[v] = Z::loadu(bp + v * Z::W);
      else b[v] = Z::load_mask(bp + v * Z::W, lanes[v]);
    }
#pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      V a;
      if constexpr (AR == ARead::direct) a = Z::bcast(ap + r * lda);
      else if constexpr (AR == ARead::direct_edge) a = Z::bcast(ap + min_size(r, last_row) * lda);
      else a = Z::bcast(r < MRS ? ap + r : ap + second_panel + (r - MRS));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) sum[r][v] = Z::fma(a, b[v], sum[r][v]);
    }
  }
  const bool full_width = nr >= std::size_t(NV * Z::W);
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r) {
    if (std::size_t(r) >= mr) break;
    T* row = c + r * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      V out = sum[r][v];
      if (full_width) {
        if (acc) out = Z::add(out, Z::loadu(row + v * Z::W));
        Z::storeu(row + v * Z::W, out);
      } else {
        if (acc) out = Z::add(out, Z::load_mask(row + v * Z::W, lanes[v]));
        Z::store_mask(row + v * Z::W, out, lanes[v]);
      }
    }
  }
}

// One tile of C: picks the full or the half-height / half-width kernel.
template <class T, int MR, int NR, ARead AR, BRead BR>
inline void micro_tile_as(std::size_t k, const T* ap, std::size_t lda, const T* bp,
                          std::size_t ldb, T* c, std::size_t ldc, std::size_t mr, std::size_t nr,
                          bool acc) {
  constexpr int NV = NR / Vec<T>::W;
  const bool half_rows = mr * 2 <= std::size_t(MR), half_cols = nr * 2 <= std::size_t(NR);
  if (half_rows && half_cols) {
    micro_vec<Vec<T>, MR / 2, MR, NR, NV / 2, AR, BR>(k, ap, lda, bp, ldb, c, ldc, mr, nr, acc);
  } else if (half_rows) {
    micro_vec<Vec<T>, MR / 2, MR, NR, NV, AR, BR>(k, ap, lda, bp, ldb, c, ldc, mr, nr, acc);
  } else if (half_cols) {
    micro_vec<Vec<T>, MR, MR, NR, NV / 2, AR, BR>(k, ap, lda, bp, ldb, c, ldc, mr, nr, acc);
  } else {
    micro_vec<Vec<T>, MR, MR, NR, NV, AR, BR>(k, ap, lda, bp, ldb, c, ldc, mr, nr, acc);
  }
}

// One tile of C starting at row `ap` (a packed panel, or a row of A read in place), `rows`
// rows of C left from there; returns the rows done: MR, or 2 MR when C is at most one vector
// wide (two row panels in one kernel, so that it still has enough accumulators).
template <class T, int MR, int NR, ARead AR, BRead BR>
inline std::size_t micro_rows(std::size_t k, const T* ap, std::size_t lda, const T* bp,
                              std::size_t ldb, T* c, std::size_t ldc, std::size_t rows,
                              std::size_t nr, bool acc) {
  constexpr ARead EDGE = AR == ARead::packed ? AR : ARead::direct_edge;
#if defined(__AVX512F__)
  // at most half a zmm wide: 256-bit vectors do the same with half the work
  if (nr * 2 <= std::size_t(Vec<T>::W) && rows > std::size_t(MR)) {
    if (rows >= std::size_t(2 * MR)) {
      micro_vec<V256<T>, 2 * MR, MR, NR, 1, AR, BR>(k, ap, lda, bp, ldb, c, ldc, 2 * MR, nr, acc);
    } else {
      micro_vec<V256<T>, 2 * MR, MR, NR, 1, EDGE, BR>(k, ap, lda, bp, ldb, c, ldc, rows, nr,
                                                      acc);
    }
    return 2 * MR;
  }
#endif
  if (nr <= std::size_t(Vec<T>::W) && rows > std::size_t(MR)) {
    if (rows >= std::size_t(2 * MR)) {
      micro_vec<Vec<T>, 2 * MR, MR, NR, 1, AR, BR>(k, ap, lda, bp, ldb, c, ldc, 2 * MR, nr, acc);
    } else {
      micro_vec<Vec<T>, 2 * MR, MR, NR, 1, EDGE, BR>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc);
    }
    return 2 * MR;
  }
  if (rows >= std::size_t(MR)) {
    micro_tile_as<T, MR, NR, AR, BR>(k, ap, lda, bp, ldb, c, ldc, MR, nr, acc);
  } else {
    micro_tile_as<T, MR, NR, EDGE, BR>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc);
  }
  return MR;
}

template <class T, int MR, int NR>
inline std::size_t micro_tile(std::size_t k, const T* ap, std::size_t lda, bool direct_a,
                              const T* bp, std::size_t ldb, bool direct_b, T* c, std::size_t ldc,
                              std::size_t rows, std::size_t nr, bool acc) {
  constexpr auto PA = ARead::packed, DA = ARead::direct;
  if (!direct_b) {
    return direct_a ? micro_rows<T, MR, NR, DA, BRead::packed>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc)
                    : micro_rows<T, MR, NR, PA, BRead::packed>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc);
  }
  if (nr == std::size_t(NR)) {
    return direct_a ? micro_rows<T, MR, NR, DA, BRead::direct>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc)
                    : micro_rows<T, MR, NR, PA, BRead::direct>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc);
  }
  return direct_a ? micro_rows<T, MR, NR, DA, BRead::direct_masked>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc)
                  : micro_rows<T, MR, NR, PA, BRead::direct_masked>(k, ap, lda, bp, ldb, c, ldc, rows, nr, acc);
}
#endif

// Each configuration gives the micro-tile (MR x NR), the cache blocking (KC, MC, NC), whether
// B may be read without packing, a `tile` computing one MR x NR block of C (or its part
// inside C, mr x nr) and the name the benchmarks print.
template <class T> struct GemmConfig {  // portable kernel (baseline build)
  static constexpr int MR = 4, NR = 8;
  static constexpr std::size_t KC = 256, MC = 96, NC = 2048;
  static constexpr bool kDirectB = false;
  static constexpr const char* name = "portable 4x8";
  static constexpr bool kDirectA = false;
  static constexpr std::size_t kDirectAPanels = 0;
  static std::size_t tile(std::size_t k, const T* ap, std::size_t /*lda*/, bool /*direct_a*/,
                          const T* bp, std::size_t /*ldb*/, bool /*direct_b*/, T* c,
                          std::size_t ldc, std::size_t rows, std::size_t nr, bool acc) {
    const std::size_t mr = rows < std::size_t(MR) ? rows : std::size_t(MR);
    if (mr == std::size_t(MR) && nr == std::size_t(NR)) {
      micro_portable<T, MR, NR>(k, ap, bp, c, ldc, acc);
      return MR;
    }
    T tmp[MR * NR];
    micro_portable<T, MR, NR>(k, ap, bp, tmp, NR, false);
    for (std::size_t r = 0; r < mr; ++r)
      for (std::size_t j = 0; j < nr; ++j)
        c[r * ldc + j] = acc ? c[r * ldc + j] + tmp[r * NR + j] : tmp[r * NR + j];
    return MR;
  }
};

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
constexpr int kMR = 12;  // rows per tile; NR = 2 vectors
constexpr const char* kSgemmName = "avx512 12x32";
constexpr const char* kDgemmName = "avx512 12x16";
#else
constexpr int kMR = 6;
constexpr const char* kSgemmName = "avx2 6x16";
constexpr const char* kDgemmName = "avx2 6x8";
#endif
// A read in place up to this many column panels, against a packed B or a B read in place
// (see use_direct_a). With a packed B on Zen 4, AVX-512 kernels (float32, two threads,
// fastest of 7 runs, four processes each): dY @ W.T of MLPResNet's 100 -> 50 layer,
// 128 x 100 x 50, 13.1 -> 11.1 us; 2048 x 512 x 128 with B transposed 1,330 -> 1,220 us;
// 300 x 3000 x 100 1,070 -> 980 us; no shape measured slower (square 256 and 512, float64
// the MLP's products).
constexpr std::size_t kDirectAPanelsPacked = 8;
#ifndef NEEDLE_SGEMM_KC  // blocking of the float32 kernel; overridable for tuning experiments
#define NEEDLE_SGEMM_KC 192
#define NEEDLE_SGEMM_MC (24 * kMR)
#define NEEDLE_SGEMM_NC 3072
#endif
template <> struct GemmConfig<float> {
  static constexpr int MR = kMR, NR = 2 * Vec<float>::W;
  static constexpr std::size_t KC = NEEDLE_SGEMM_KC, MC = NEEDLE_SGEMM_MC, NC = NEEDLE_SGEMM_NC;
  static constexpr bool kDirectB = true, kDirectA = true;
  static constexpr std::size_t kDirectAPanels = kDirectAPanelsPacked;
  static constexpr const char* name = kSgemmName;
  static std::size_t tile(std::size_t k, const float* ap, std::size_t lda, bool direct_a,
                          const float* bp, std::size_t ldb, bool direct_b, float* c, std::size_t ldc,
                          std::size_t rows, std::size_t nr, bool acc) {
    return micro_tile<float, MR, NR>(k, ap, lda, direct_a, bp, ldb, direct_b, c, ldc, rows, nr,
                                   acc);
  }
};
template <> struct GemmConfig<double> {
  static constexpr int MR = kMR, NR = 2 * Vec<double>::W;
  static constexpr std::size_t KC = 256, MC = 16 * kMR, NC = 2048;
  static constexpr bool kDirectB = true, kDirectA = true;
  static constexpr std::size_t kDirectAPanels = kDirectAPanelsPacked;
  static constexpr const char* name = kDgemmName;
  static std::size_t tile(std::size_t k, const double* ap, std::size_t lda, bool direct_a,
                          const double* bp, std::size_t ldb, bool direct_b, double* c, std::size_t ldc,
                          std::size_t rows, std::size_t nr, bool acc) {
    return micro_tile<double, MR, NR>(k, ap, lda, direct_a, bp, ldb, direct_b, c, ldc, rows, nr,
                                   acc);
  }
};
#endif
