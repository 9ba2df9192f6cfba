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
// Micro-kernels and blocking per instruction set: gemm_micro_impl.h (AVX-512 12x32 / 12x16,
// AVX2 6x16 / 6x8, a portable one for the baseline build). Small products skip packing: a
// row-major B of at most 256 KiB is read in place, and so is a row-major A when C has a
// single column panel (each of its elements is read once either way). float16 is converted
// to float32, multiplied, rounded.

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

// This thread's index and team size in the innermost OpenMP region (0 and 1 outside one).
inline int team_rank() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

inline std::size_t min_size(std::size_t a, std::size_t b) { return a < b ? a : b; }
inline std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

// ---- packing ---------------------------------------------------------------------------------
// Both operands are packed into panels of W "lines" (W = MR rows of A, or NR columns of B)
// stored k-major: dst[kk * W + j] = line j's element kk, zero for lines past `lines`. A line's
// element kk is at src[j * ls + kk * ks]; which of the two strides is 1 decides the loop:
// ks == 1 (rows of a compact A, columns of a transposed B) transposes blocks in registers,
// ls == 1 (a transposed A, rows of a compact B) copies W values per kk.

#if defined(__AVX2__)
// dst[kk * W + j] = src_j[kk] for 8 lines and 8 consecutive kk (float), in registers.
inline void transpose8x8(const float* const* src, std::size_t kk, float* dst, std::size_t w) {
  __m256 r[8], t[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src[j] + kk);
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
    r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xee);
    r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xee);
  }
  // r[0..3] hold columns 0,1,2,3 of lines 0-3 | 4-7 in 128-bit halves (likewise r[4..7])
  const int order[4] = {0, 1, 2, 3};
  for (int q : order) {
    _mm256_storeu_ps(dst + (q)*w, _mm256_permute2f128_ps(r[q], r[q + 4], 0x20));
    _mm256_storeu_ps(dst + (q + 4) * w, _mm256_permute2f128_ps(r[q], r[q + 4], 0x31));
  }
}

// 4 lines of floats and 8 consecutive kk: each kk gets one 128-bit store of 4 values.
inline void transpose4x8(const float* const* src, std::size_t kk, float* dst, std::size_t w) {
  const __m256 r0 = _mm256_loadu_ps(src[0] + kk), r1 = _mm256_loadu_ps(src[1] + kk);
  const __m256 r2 = _mm256_loadu_ps(src[2] + kk), r3 = _mm256_loadu_ps(src[3] + kk);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xee),
                       _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xee)};
  for (int q = 0; q < 4; ++q) {  // u[q] = kk + q in the low half, kk + q + 4 in the high half
    _mm_storeu_ps(dst + q * w, _mm256_castps256_ps128(u[q]));
    _mm_storeu_ps(dst + (q + 4) * w, _mm256_extractf128_ps(u[q], 1));
  }
}

// The same for 4 lines of doubles and 4 consecutive kk.
inline void transpose4x4(const double* const* src, std::size_t kk, double* dst, std::size_t w) {
  const __m256d r0 = _mm256_loadu_pd(src[0] + kk), r1 = _mm256_loadu_pd(src[1] + kk);
  const __m256d r2 = _mm256_loadu_pd(src[2] + kk), r3 = _mm256_loadu_pd(src[3] + kk);
  const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
  const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
  _mm256_storeu_pd(dst, _mm256_permute2f128_pd(t0, t2, 0x20));
  _mm256_storeu_pd(dst + w, _mm256_permute2f128_pd(t1, t3, 0x20));
  _mm256_storeu_pd(dst + 2 * w, _mm256_permute2f128_pd(t0, t2, 0x31));
  _mm256_storeu_pd(dst + 3 * w, _mm256_permute2f128_pd(t1, t3, 0x31));
}
#endif

// The lines of a panel whose lines are contiguous along kk, 8 or 4 at a time through the
// register transposes where the build has them; returns how many lines were done.
template <class T>
std::size_t pack_lines_transposed(const T* const* line, std::size_t lines, std::size_t k,
                                  T* dst, std::size_t w) {
  std::size_t j0 = 0;
#if defined(__AVX2__)
  constexpr std::size_t KB = std::is_same_v<T, float> ? 8 : 4;  // kk per register
  const std::size_t k_main = k / KB * KB;
  while (j0 + 4 <= lines) {
    // 8 lines at a time for floats while they last, else 4
    const std::size_t lb = (std::is_same_v<T, float> && j0 + 8 <= lines) ? 8 : 4;
    for (std::size_t kk = 0; kk < k_main; kk += KB) {
      if constexpr (std::is_same_v<T, float>) {
        if (lb == 8) transpose8x8(line + j0, kk, dst + kk * w + j0, w);
        else transpose4x8(line + j0, kk, dst + kk * w + j0, w);
      } else {
        transpose4x4(line + j0, kk, dst + kk * w + j0, w);
      }
    }
    for (std::size_t kk = k_main; kk < k; ++kk)
      for (std::size_t j = j0; j < j0 + lb; ++j) dst[kk * w + j] = line[j][kk];
    j0 += lb;
  }
#endif
  (void)line; (void)lines; (void)k; (void)dst; (void)w;
  return j0;
}

template <class T, int W>
void pack_panel(const T* src, std::ptrdiff_t ls, std::ptrdiff_t ks, std::size_t lines,
                std::size_t k, T* dst) {
  if (ls == 1) {
    if (lines == std::size_t(W)) {  // a full panel: a copy of fixed width (vector moves)
      for (std::size_t kk = 0; kk < k; ++kk, dst += W) {
        const T* s = src + std::ptrdiff_t(kk) * ks;
        for (int j = 0; j < W; ++j) dst[j] = s[j];
      }
      return;
    }
    for (std::size_t kk = 0; kk < k; ++kk, dst += W) {
      const T* s = src + std::ptrdiff_t(kk) * ks;
      std::size_t j = 0;
      for (; j < lines; ++j) dst[j] = s[j];
      for (; j < std::size_t(W); ++j) dst[j] = T(0);
    }
    return;
  }
  const T* line[W];
  for (std::size_t j = 0; j < lines; ++j) line[j] = src + std::ptrdiff_t(j) * ls;
  std::size_t done = 0;
  if (ks == 1) done = pack_lines_transposed<T>(line, lines, k, dst, W);
  for (std::size_t kk = 0; kk < k; ++kk) {
    T* d = dst + kk * W;
    for (std::size_t j = done; j < lines; ++j) d[j] = line[j][std::ptrdiff_t(kk) * ks];
    for (std::size_t j = lines; j < std::size_t(W); ++j) d[j] = T(0);
  }
}

// A rows [0, rows) x cols [0, k) -> panels of MR rows, each stored k-major (MR values per k).
// A is strided: element (i, kk) at a[i * rs + kk * cs].
template <class T, int MR>
void pack_a(const T* a, std::ptrdiff_t rs, std::ptrdiff_t cs, std::size_t rows, std::size_t k,
            T* dst) {
  for (std::size_t i0 = 0; i0 < rows; i0 += MR, dst += MR * k) {
    pack_panel<T, MR>(a + std::ptrdiff_t(i0) * rs, rs, cs, min_size(MR, rows - i0), k, dst);
  }
}

// One NR-column panel of B rows [0, k): NR values per k, zero padded past `cols`.
// B is strided: element (kk, c) at b[kk * rs + c * cs].
template <class T, int NR>
void pack_b_panel(const T* b, std::ptrdiff_t rs, std::ptrdiff_t cs, std::size_t k,
                  std::size_t cols, T* dst) {
  pack_panel<T, NR>(b, cs, rs, cols, k, dst);
}

// Rows of B at least this far apart (bytes) are packed row by row (pack_b_rows); closer
// rows stay within a few pages, and panel by panel was as fast or faster there (128 x 784 x
// 100, rows of 400 bytes: 10% slower row by row at 2 threads).
constexpr std::size_t kRowPackMinStride = 1024;
// Largest B (packed, every K block) packed before any block is multiplied (see gemm_nt).
constexpr std::size_t kPackAllBytes = 512 * 1024;
// Largest B (packed, every K block) each thread packs for itself rather than sharing.
constexpr std::size_t kPrivatePackBytes = 64 * 1024;

// Panels [jp0, jp1) of a row-major B block (kc rows of nc values, row stride brs) packed
// row by row: each row's values are read in one contiguous run. Packing panel by panel
// reads NR values from each of kc rows in turn, kc streams at once, which the hardware
// prefetcher cannot follow when the rows are far apart: for the LSTM head's X.T @ dY (B
// 320 x 10000) that took 37% of the product's time; 512^3 float32 went 18% faster on Zen 3.
template <class T, int NR>
void pack_b_rows(const T* b, std::ptrdiff_t brs, std::size_t kc, std::size_t nc,
                 std::size_t jp0, std::size_t jp1, T* bpack) {
  for (std::size_t kk = 0; kk < kc; ++kk) {
    const T* row = b + std::ptrdiff_t(kk) * brs;
    for (std::size_t jp = jp0; jp < jp1; ++jp) {
      const std::size_t j0 = jp * NR;
      const T* src = row + j0;
      T* dst = bpack + jp * NR * kc + kk * NR;
      if (j0 + NR <= nc) {
        for (int j = 0; j < NR; ++j) dst[j] = src[j];
      } else {
        const std::size_t width = nc - j0;
        for (std::size_t j = 0; j < width; ++j) dst[j] = src[j];
        for (std::size_t j = width; j < std::size_t(NR); ++j) dst[j] = T(0);
      }
    }
  }
}

// Panels [jp0, jp1) of the kc x nc block of B at `bblock` packed into `dst` (panel jp at
// dst + jp * NR * kc): row by row when B's rows lie far apart (pack_b_rows), else panel by
// panel.
template <class T, int NR>
void pack_b_block(const T* bblock, std::ptrdiff_t brs, std::ptrdiff_t bcs, std::size_t kc,
                  std::size_t nc, std::size_t jp0, std::size_t jp1, T* dst) {
  if (bcs == 1 && std::size_t(brs) * sizeof(T) >= kRowPackMinStride) {
    return pack_b_rows<T, NR>(bblock, brs, kc, nc, jp0, jp1, dst);
  }
  for (std::size_t jp = jp0; jp < jp1; ++jp) {
    const std::size_t j0 = jp * NR;
    pack_b_panel<T, NR>(bblock + std::ptrdiff_t(j0) * bcs, brs, bcs, kc, min_size(NR, nc - j0),
                        dst + jp * NR * kc);
  }
}

#include "gemm_micro_impl.h"

// A row-major B of at most this many bytes is read in place by the micro-kernel instead of
// being packed: for small products packing B costs more than its better cache behaviour
// saves (64^3 float32: 0.87 -> 0.93x OpenBLAS on the AVX-512 VM). Larger Bs are packed: with
// a row stride of a multiple of 4 KiB their rows would fight over the same L1 sets.
constexpr std::size_t kDirectBBytes = std::size_t(256) << 10;

// Up to 1 MiB of B is read in place too when C has few rows (each packed B value would serve
// few row tiles, so packing cost about what it saved: X.T @ dZ of the LSTM LM, 100 x 320 x
// 400 float32, 180 -> 139 us on two threads; the MLP's x @ W, 128 x 784 x 100, 139 ->
// 119 us) and B's rows spread over L1's sets. Rows a multiple of 4 lines apart fall into at
// most 16 of its 64 sets and evict each other: 512 x 512 read in place ran at 0.27x NumPy.
constexpr std::size_t kDirectBFewRowsBytes = std::size_t(1) << 20;
constexpr std::size_t kDirectBFewRows = 256;

inline bool rows_spread_over_sets(std::size_t row_bytes) {
  // not whole lines apart: rows start at different offsets within lines; else a stride of
  // an odd or twice-odd number of lines visits 64 or 32 sets
  return row_bytes % 64 != 0 || (row_bytes / 64) % 4 != 0;
}

inline bool use_direct_b(std::size_t m, std::size_t n, std::size_t p, std::size_t item,
                         std::size_t row_bytes) {
  const std::size_t bytes = n * p * item;
  if (bytes <= kDirectBBytes) return true;
  return m <= kDirectBFewRows && bytes <= kDirectBFewRowsBytes &&
         rows_spread_over_sets(row_bytes);
}

// A's rows read in place by the micro-kernel (A row-major, acs == 1) instead of packed, where
// each packed row of A would serve few tiles: at most `max_panels` column panels (with B
// read in place too, two panels whatever A's stride, where packing would read A as often as
// the kernel does, and write it). `dY @ W.T` of the LSTM LM's 10,000-wide head, 320 x 10000
// x 100 float32, went from 0.81-0.99x to 1.10-1.12x NumPy on Zen 3; with B in place, up to
// eight panels on Zen 4 (float32, two threads): the MLP's x @ W, 128 x 784 x 100, 111 ->
// 100 us, 4096 x 256 x 128 1,330 -> 1,225 us, 320 x 400 x 100 139 -> 126 us, 8192 x 32 x 96
// 269 -> 246 us. Not when A's row stride is near a multiple of 4 KiB: the rows of a tile
// then share L1 sets and evict each other (256 x 1024 x 200 read in place: 570 -> 700 us).
inline bool use_direct_a(bool direct_b, std::ptrdiff_t ars, std::size_t p, std::size_t nr,
                         std::size_t item, std::size_t max_panels) {
  if (direct_b && p <= 2 * nr) return true;
  const std::size_t row_bytes = std::size_t(ars) * item, stride_mod = row_bytes % 4096;
  const bool spread = row_bytes < 4096 - 256 || (stride_mod >= 256 && stride_mod <= 4096 - 256);
  return ceil_div(p, nr) <= max_panels && spread;
}

// C of few rows and many columns against a B that must be packed (the LSTM LM's X.T @ dY,
// 100 x 320 x 10000): each packed B block serves a single row block, so gemm_nt's blocks of
// NC columns (kc x NC values, 2.3 MiB for float32 on AVX2) would be written to and read back
// from L3. Here each thread takes a range of columns and packs B `GemmNarrow<T>::kPanels`
// panels at a time into its own L2-resident buffer, asking for the next block's rows while it
// computes the current one (the pack otherwise waits on memory: B is read exactly once); A is
// packed once per K block, not once per block of columns. The K blocks and micro-tiles are
// gemm_nt's, in the same order for every C tile, so the sums are bitwise the same.
template <class T> struct GemmNarrow {
  // columns per packed block: 4 panels of 16 (AVX2) or 8 of 32 (AVX-512) measured fastest
  // for 100 x 320 x 10000 float32 on Zen 4 (AVX2: 7.3 -> 6.9 ms; AVX-512 6.7 -> 6.4 ms)
  static constexpr std::size_t kPanels = GemmConfig<T>::MR >= 12 ? 8 : 4;
};

template <class T>
inline bool use_narrow(std::size_t m, std::size_t p, int nt, bool direct_b) {
  using G = GemmConfig<T>;
  return !direct_b && m <= G::MC && p >= 4 * std::size_t(nt) * GemmNarrow<T>::kPanels * G::NR;
}

// Asks for rows [0, rows) x columns [0, cols) of B (row stride brs) to be brought into L2.
template <class T>
void prefetch_rows(const T* b, std::ptrdiff_t brs, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(b + std::ptrdiff_t(r) * brs);
    for (std::size_t off = 0; off < cols * sizeof(T); off += 64) {
      __builtin_prefetch(row + off, 0, 2);  // into L2 (prefetcht1)
    }
  }
}

template <class T>
void gemm_narrow(const T* a, std::ptrdiff_t ars, std::ptrdiff_t acs, const T* b,
                 std::ptrdiff_t brs, std::ptrdiff_t bcs, T* c, std::size_t ldc, std::size_t m,
                 std::size_t n, std::size_t p, int nt, bool accumulate, bool direct_a) {
  using G = GemmConfig<T>;
  constexpr std::size_t MR = G::MR, NR = G::NR, NC = GemmNarrow<T>::kPanels * NR;
  const std::size_t kc_max = min_size(G::KC, n), k_blocks = ceil_div(n, G::KC);
  const std::size_t a_slot = kc_max * ceil_div(m, MR) * MR;
  const bool rows_apart = bcs == 1 && std::size_t(brs) * sizeof(T) >= kRowPackMinStride;
  const auto body = [&](std::size_t rank, std::size_t teams) {
    T* apack = direct_a ? nullptr : tls_pack_a.get<T>(k_blocks * a_slot);
    T* bpack = tls_pack_b.get<T>(kc_max * NC);
    // this thread's columns: whole blocks of NC
    const std::size_t blocks = ceil_div(p, NC);
    const std::size_t j_begin = blocks * rank / teams * NC;
    const std::size_t j_end = min_size(blocks * (rank + 1) / teams * NC, p);
    for (std::size_t jc = j_begin; jc < j_end; jc += NC) {
      const std::size_t nc = min_size(NC, j_end - jc), panels = ceil_div(nc, NR);
      for (std::size_t pc = 0; pc < n; pc += G::KC) {
        const std::size_t kc = min_size(G::KC, n - pc);
        const T* bblock = b + std::ptrdiff_t(pc) * brs + std::ptrdiff_t(jc) * bcs;
        pack_b_block<T, NR>(bblock, brs, bcs, kc, nc, 0, panels, bpack);
        if (rows_apart && jc + nc < j_end) {  // the next block's rows, while this one runs
          prefetch_rows(bblock + nc, brs, kc, min_size(NC, j_end - jc - nc));
        }
        T* const aslot = direct_a ? nullptr : apack + (pc / G::KC) * a_slot;
        if (!direct_a && jc == j_begin) {
          pack_a<T, MR>(a + std::ptrdiff_t(pc) * acs, ars, acs, m, kc, aslot);
        }
        for (std::size_t jp = 0; jp < panels; ++jp) {
          const std::size_t j0 = jp * NR, nr = min_size(NR, nc - j0);
          const T* bp = bpack + jp * NR * kc;
          for (std::size_t i0 = 0; i0 < m;) {
            const T* ap = direct_a ? a + std::ptrdiff_t(i0) * ars + std::ptrdiff_t(pc)
                                   : aslot + i0 * kc;
            i0 += G::tile(kc, ap, std::size_t(ars), direct_a, bp, 0, false,
                          c + i0 * ldc + jc + j0, ldc, m - i0, nr, accumulate || pc > 0);
          }
        }
      }
    }
  };
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    body(std::size_t(team_rank()), std::size_t(team_size()));
  } else {
    body(0, 1);
  }
}

// One function for the whole loop nest (longer than our usual 40 lines) because the OpenMP
// region must enclose every loop: a region per block would fork and join thousands of times.
// a(i, k) = a[i * ars + k * acs], b(k, j) = b[k * brs + j * bcs]; c is compact m x p. Packing
// reads any strides, so transposed or sliced operands need no compact copy first.
// `ldc` is C's row stride; with `accumulate` the product is added to C instead of replacing
// it; `nt` threads share the work (1: the calling thread alone, no OpenMP region).
template <class T>
void gemm_nt(const T* a, std::ptrdiff_t ars, std::ptrdiff_t acs, const T* b, std::ptrdiff_t brs,
             std::ptrdiff_t bcs, T* c, std::size_t ldc, std::size_t m, std::size_t n,
             std::size_t p, int nt, bool accumulate) {
  using G = GemmConfig<T>;
  constexpr std::size_t MR = G::MR, NR = G::NR;
  if (m == 0 || p == 0) return;
  if (n == 0) {
    if (!accumulate) {
      for (std::size_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, p * sizeof(T));
    }
    return;
  }
  // Row blocks: a multiple of the thread count when that fits, so the static split is even,
  // and of equal height even when that is not a multiple of MR: 128 rows on two threads are
  // 64 + 64 (five tiles and a 4-row edge tile each), not 72 + 56 (six tiles against five).
  const std::size_t ic_blocks = std::size_t(nt) * ceil_div(m, std::size_t(nt) * G::MC);
  const std::size_t mc = min_size(G::MC, ceil_div(m, ic_blocks));
  const std::size_t n_ic = ceil_div(m, mc);
  const std::size_t nc_max = min_size(G::NC, ceil_div(p, NR) * NR);
  const std::size_t kc_max = min_size(G::KC, n);
  const bool direct_b = G::kDirectB && bcs == 1 &&
                        use_direct_b(m, n, p, sizeof(T), std::size_t(brs) * sizeof(T));
  // A read in place or packed: see use_direct_a
  const bool direct_a = G::kDirectA && acs == 1 && use_direct_a(direct_b, ars, p, NR, sizeof(T),
                                                               G::kDirectAPanels);
  if (use_narrow<T>(m, p, nt, direct_b)) {
    return gemm_narrow(a, ars, acs, b, brs, bcs, c, ldc, m, n, p, nt, accumulate, direct_a);
  }
  // B packed for every K block at once when all of it is small enough to stay in L2: the
  // threads then wait for each other once, not twice per K block (128x784x100 on two
  // threads: one barrier instead of ten). Each C tile still belongs to one thread and sees
  // the K blocks in order, so the sums are bitwise those of the block-by-block schedule.
  const std::size_t k_blocks = ceil_div(n, G::KC);
  const std::size_t all_bytes = k_blocks * kc_max * nc_max * sizeof(T);
  // A small B is packed whole by every thread for itself: no barrier at all, where sharing
  // the packing costs two (dY @ W.T of MLPResNet's 100 -> 50 layer, 128 x 100 x 50 with B
  // transposed, two threads: 22.6 us against 16.0 us on one thread).
  const bool private_b = !direct_b && nt > 1 && p <= G::NC && all_bytes <= kPrivatePackBytes;
  const bool pack_all = !direct_b && nt > 1 && p <= G::NC &&
                        (private_b || (k_blocks > 1 && all_bytes <= kPackAllBytes));
  T* bpack = direct_b || private_b
                 ? nullptr
                 : tls_pack_b.get<T>((pack_all ? k_blocks : 1) * kc_max * nc_max);

  // The loop nest runs in one parallel region; a single-threaded call skips the region (its
  // set-up costs microseconds, as much as a whole 64 x 64 product). The `omp for` loops
  // below also work outside a region (a team of one).
  // rank/teams split the loops statically (the contiguous ranges of `omp for
  // schedule(static)`), written out because a single-threaded call may run inside another
  // kernel's parallel region (the convolutions call it per chunk), where an orphaned `omp
  // for` or barrier would bind to that outer team.
  const auto body = [&](std::size_t rank, std::size_t teams) {
    const auto share = [&](std::size_t count) {
      return std::make_pair(count * rank / teams, count * (rank + 1) / teams);
    };
    T* apack = tls_pack_a.get<T>(kc_max * ceil_div(mc, MR) * MR);
    T* const bbuf = private_b ? tls_pack_b.get<T>(k_blocks * kc_max * nc_max) : bpack;
    const bool shared_b = teams > 1 && !direct_b && !private_b;  // threads wait for the packing
    std::size_t packed_ic = ~std::size_t(0), packed_pc = ~std::size_t(0);
    for (std::size_t jc = 0; jc < p; jc += G::NC) {
      const std::size_t nc = min_size(G::NC, p - jc);
      const std::size_t panels = ceil_div(nc, NR);
      // With fewer row blocks than threads, each row block's panels are split further.
      const std::size_t jr_parts =
          n_ic >= std::size_t(nt) ? 1 : min_size(panels, ceil_div(nt, n_ic));
      // this thread's share of the panels of K block `pc`, packed into `dst`
      const auto pack_block = [&](std::size_t pc, T* dst) {
        const auto packs = private_b ? std::make_pair(std::size_t(0), panels)
                                     : share(direct_b ? 0 : panels);
        pack_b_block<T, NR>(b + std::ptrdiff_t(pc) * brs + std::ptrdiff_t(jc) * bcs, brs, bcs,
                            min_size(G::KC, n - pc), nc, packs.first, packs.second, dst);
      };
      if (pack_all) {
        for (std::size_t pc = 0; pc < n; pc += G::KC) {
          pack_block(pc, bbuf + (pc / G::KC) * kc_max * nc_max);
        }
        if (shared_b) {
#pragma omp barrier
        }
      }
      for (std::size_t pc = 0; pc < n; pc += G::KC) {
        const std::size_t kc = min_size(G::KC, n - pc);
        const T* bblock = b + std::ptrdiff_t(pc) * brs + std::ptrdiff_t(jc);
        T* const bslot = pack_all ? bbuf + (pc / G::KC) * kc_max * nc_max : bbuf;
        if (!pack_all) {
          pack_block(pc, bbuf);
          if (shared_b) {
#pragma omp barrier
          }
        }
        const auto items = share(n_ic * jr_parts);
        for (std::size_t item = items.first; item < items.second; ++item) {
          const std::size_t ib = item / jr_parts, part = item % jr_parts;
          const std::size_t ic = ib * mc, mcur = min_size(mc, m - ic);
          if (!direct_a && (packed_ic != ic || packed_pc != pc)) {
            pack_a<T, MR>(a + std::ptrdiff_t(ic) * ars + std::ptrdiff_t(pc) * acs, ars, acs,
                          mcur, kc, apack);
            packed_ic = ic;
            packed_pc = pc;
          }
          const std::size_t jp0 = panels * part / jr_parts, jp1 = panels * (part + 1) / jr_parts;
          for (std::size_t jp = jp0; jp < jp1; ++jp) {
            const std::size_t j0 = jp * NR, nr = min_size(NR, nc - j0);
            const T* bp = direct_b ? bblock + j0 : bslot + jp * NR * kc;
            const T* ablock = a + std::ptrdiff_t(ic) * ars + std::ptrdiff_t(pc);
            for (std::size_t i0 = 0; i0 < mcur;) {
              const T* ap = direct_a ? ablock + std::ptrdiff_t(i0) * ars : apack + i0 * kc;
              i0 += G::tile(kc, ap, std::size_t(ars), direct_a, bp, std::size_t(brs), direct_b,
                            c + (ic + i0) * ldc + jc + j0, ldc, mcur - i0, nr,
                            accumulate || pc > 0);
            }
          }
        }
        if (shared_b && !pack_all) {  // the next block's packing overwrites bpack
#pragma omp barrier
        }
      }
    }
  };
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    body(std::size_t(team_rank()), std::size_t(team_size()));
  } else {
    body(0, 1);
  }
}

// c (1 x p) = a (1 x n) @ B (n x p) with B's rows contiguous (bcs == 1): a column sum
// `ones(1, M) @ X` (every bias gradient) or a vector-matrix product. Memory-bound, so B is
// read once, row by row, into a strip of c that stays in cache; the packed kernel would copy
// all of B into panels first and use one of its MR rows. Each c[j] sums k = 0..n-1 in order,
// whatever the thread count.
template <class T>
void gemv_rows(const T* a, std::ptrdiff_t acs, const T* b, std::ptrdiff_t brs, T* c,
               std::size_t n, std::size_t p, int nt) {
  // Strips of c at most 32 KiB (kept in L1/L2 while B's rows stream by), at least one per
  // thread, as wide as that allows: long contiguous pieces of each row of B, which is what
  // keeps the read near DRAM speed when B is large.
  constexpr std::size_t kMaxStrip = 32768 / sizeof(T);
  const std::size_t strips = std::max(ceil_div(p, kMaxStrip), std::size_t(nt));
  const std::size_t strip = ceil_div(ceil_div(p, strips), std::size_t(16)) * 16;
  const auto body = [&](std::size_t rank, std::size_t teams) {
    for (std::size_t s = strips * rank / teams; s < strips * (rank + 1) / teams; ++s) {
      const std::size_t j0 = s * strip;
      if (j0 >= p) break;
      const std::size_t width = min_size(strip, p - j0);
      T* __restrict out = c + j0;
      for (std::size_t j = 0; j < width; ++j) out[j] = T(0);
      const T* first = b + std::ptrdiff_t(j0);
      std::size_t k = 0;
      // four rows per pass over the strip (a quarter of its loads and stores); each c[j]
      // still adds its terms in k order
      for (; k + 4 <= n; k += 4) {
        const T a0 = a[std::ptrdiff_t(k) * acs], a1 = a[std::ptrdiff_t(k + 1) * acs];
        const T a2 = a[std::ptrdiff_t(k + 2) * acs], a3 = a[std::ptrdiff_t(k + 3) * acs];
        const T* __restrict r0 = first + std::ptrdiff_t(k) * brs;
        const T* __restrict r1 = r0 + brs;
        const T* __restrict r2 = r1 + brs;
        const T* __restrict r3 = r2 + brs;
        for (std::size_t j = 0; j < width; ++j) {
          T acc = out[j];
          acc += a0 * r0[j];
          acc += a1 * r1[j];
          acc += a2 * r2[j];
          acc += a3 * r3[j];
          out[j] = acc;
        }
      }
      for (; k < n; ++k) {
        const T ak = a[std::ptrdiff_t(k) * acs];
        const T* __restrict row = first + std::ptrdiff_t(k) * brs;
        for (std::size_t j = 0; j < width; ++j) out[j] += ak * row[j];
      }
    }
  };
  if (nt > 1 && strips > 1) {
#pragma omp parallel num_threads(nt)
    body(std::size_t(team_rank()), std::size_t(team_size()));
  } else {
    body(0, 1);
  }
}

// C (m x p, compact) = A @ B on as many threads as the work is worth.
template <class T>
void gemm(const T* a, std::ptrdiff_t ars, std::ptrdiff_t acs, const T* b, std::ptrdiff_t brs,
          std::ptrdiff_t bcs, T* c, std::size_t m, std::size_t n, std::size_t p) {
  const double flops = 2.0 * double(m) * double(n) * double(p);
  if (m == 1 && bcs == 1 && n > 0) {  // memory-bound: threads by the bytes of B read
    const int nt = n * p >= kParallelMinElements ? num_threads() : 1;
    return gemv_rows(a, acs, b, brs, c, n, p, nt);
  }
  const int nt = flops >= parallel_min_flops() ? num_threads() : 1;
  gemm_nt(a, ars, acs, b, brs, bcs, c, p, m, n, p, nt, false);
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
  // float16 / bfloat16: widen both operands, multiply in float32, round the result once.
  float* af = static_cast<float*>(needle_alloc((m * n + n * p + m * p) * sizeof(float)));
  float* bf = af + m * n;
  float* cf = bf + n * p;
  try {
    cast(t, a, DType::f32, af, m * n);
    cast(t, b, DType::f32, bf, n * p);
    gemm(af, std::ptrdiff_t(n), 1, bf, std::ptrdiff_t(p), 1, cf, m, n, p);
    cast(DType::f32, cf, t, out, m * p);
  } catch (...) {
    needle_free(af);
    throw;
  }
  needle_free(af);
}

// out(m x p) = A @ B for strided float32/float64 operands (see gemm); float16 and bfloat16
// callers compact.
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
  throw std::invalid_argument(std::string("matmul_strided: expected float32 or float64, got ") +
                              dtype_name(t));
}
