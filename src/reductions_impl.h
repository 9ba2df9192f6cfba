// Reductions over contiguous blocks: out[r] = op(a[r*size : (r+1)*size]).
// Included inside `namespace needle::<isa>` (see elementwise_impl.h).
//
// Sums add 2048-element blocks in vector lanes of the element type (float32 for float16) and
// the block sums in double, so the error stays near that of NumPy's pairwise summation.
// max/min propagate NaN like NumPy; an empty block gives 0 / -inf / +inf.

constexpr std::size_t kSumBlock = 2048;

// Independent accumulators: 128 bytes of them (4 ymm registers), so the loop is limited by
// loads rather than by the latency of one add or max chain.
template <class T> constexpr int kLanesOf = int(128 / sizeof(T));

template <class T>
T block_sum(const T* a, std::size_t n) {
  constexpr int L = kLanesOf<T>;
  T lanes[L] = {};
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
#pragma omp simd
    for (int j = 0; j < L; ++j) lanes[j] += a[i + j];
  }
  // the tail goes into the lanes as well and the lanes are added pairwise: no serial chain
  // of up to 2L dependent adds, which cost a short row (a bias gradient's H*W values per
  // image and channel) more than its loads
  for (std::size_t j = 0; i + j < n; ++j) lanes[j] += a[i + j];
  for (int w = L / 2; w > 0; w /= 2) {
#pragma omp simd
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  }
  return lanes[0];
}

template <RedOp OP, class T>
inline T pick(T acc, T x) {
  if constexpr (OP == RedOp::max) return (x > acc || x != x) ? x : acc;
  return (x < acc || x != x) ? x : acc;
}

template <RedOp OP, class T>
T block_extreme_scalar(const T* a, std::size_t n, T init) {
  constexpr int L = kLanesOf<T>;
  T lanes[L];
  for (int j = 0; j < L; ++j) lanes[j] = init;
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
#pragma omp simd
    for (int j = 0; j < L; ++j) lanes[j] = pick<OP>(lanes[j], a[i + j]);
  }
  T acc = init;
  for (; i < n; ++i) acc = pick<OP>(acc, a[i]);
  for (int j = 0; j < L; ++j) acc = pick<OP>(acc, lanes[j]);
  return acc;
}

#if defined(__AVX2__)
// max/min with vector max/min instructions, which drop a NaN operand (they return their second
// operand when either is NaN): NaNs are tracked apart with one unordered compare per vector and
// the block returns NaN if it saw one. 4 accumulators hide the instruction latency. The
// AVX-512 build uses 512-bit vectors and mask registers for the NaN flags.
template <RedOp OP, class T>
T block_extreme(const T* a, std::size_t n, T init) {
#if defined(__AVX512F__)
  using Z = V512<T>;
#else
  using Z = V256<T>;
#endif
  using V = typename Z::V;
  constexpr std::size_t W = Z::W;
  V acc[4];
  for (auto& v : acc) v = Z::set1(init);
  typename Z::NanFlags nan = Z::no_nan();
  std::size_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const V x = Z::loadu(a + i + j * W);
      acc[j] = OP == RedOp::max ? Z::max(x, acc[j]) : Z::min(x, acc[j]);
      nan = Z::flag_nan(nan, x);
    }
  }
  for (; i + W <= n; i += W) {
    const V x = Z::loadu(a + i);
    acc[0] = OP == RedOp::max ? Z::max(x, acc[0]) : Z::min(x, acc[0]);
    nan = Z::flag_nan(nan, x);
  }
  if (Z::any_nan(nan)) return std::numeric_limits<T>::quiet_NaN();
  alignas(64) T lanes[4 * W];
  for (int j = 0; j < 4; ++j) Z::storeu(lanes + j * W, acc[j]);
  T out = init;
  for (std::size_t j = 0; j < 4 * W; ++j) out = pick<OP>(out, lanes[j]);
  for (; i < n; ++i) out = pick<OP>(out, a[i]);
  return out;
}
#else
template <RedOp OP, class T>
T block_extreme(const T* a, std::size_t n, T init) {
  return block_extreme_scalar<OP>(a, n, init);
}
#endif

template <RedOp OP> constexpr double reduce_init() {
  return OP == RedOp::sum ? 0.0 : (OP == RedOp::max ? -HUGE_VAL : HUGE_VAL);
}

template <RedOp OP>
inline double combine(double acc, double x) {
  if constexpr (OP == RedOp::sum) return acc + x;
  return pick<OP>(acc, x);
}

// Reduces a[0..n) of dtype t; the partial result is exact in double for max/min.
template <RedOp OP>
double reduce_span(DType t, const void* a, std::size_t s, std::size_t e) {
  double acc = reduce_init<OP>();
  if (is_low_precision(t)) {
    alignas(64) float buf[kHalfBlock];
    for (std::size_t i = s; i < e; i += kHalfBlock) {
      const std::size_t len = e - i < kHalfBlock ? e - i : kHalfBlock;
      load_small(t, static_cast<const std::uint16_t*>(a) + i, buf, len);
      acc = combine<OP>(acc, OP == RedOp::sum ? block_sum(buf, len)
                                               : block_extreme<OP>(buf, len, float(acc)));
    }
    return acc;
  }
  if (OP != RedOp::sum) {  // exact in any order: one pass, one horizontal step at the end
    if (t == DType::f32) {
      return combine<OP>(acc, block_extreme<OP>(static_cast<const float*>(a) + s, e - s,
                                                float(acc)));
    }
    return combine<OP>(acc, block_extreme<OP>(static_cast<const double*>(a) + s, e - s, acc));
  }
  for (std::size_t i = s; i < e; i += kSumBlock) {
    const std::size_t len = e - i < kSumBlock ? e - i : kSumBlock;
    if (t == DType::f32) {
      const float* p = static_cast<const float*>(a) + i;
      acc = combine<OP>(acc, OP == RedOp::sum ? block_sum(p, len)
                                               : block_extreme<OP>(p, len, float(acc)));
    } else {
      const double* p = static_cast<const double*>(a) + i;
      acc = combine<OP>(acc, OP == RedOp::sum ? block_sum(p, len)
                                               : block_extreme<OP>(p, len, acc));
    }
  }
  return acc;
}

inline void store_value(DType t, void* out, std::size_t i, double v) {
  if (t == DType::f32) static_cast<float*>(out)[i] = float(v);
  else if (t == DType::f64) static_cast<double*>(out)[i] = v;
  else if (t == DType::bf16) static_cast<bf16_bits*>(out)[i] = double_to_bf16(v);
  else static_cast<half_bits*>(out)[i] = double_to_half(v);
}

template <RedOp OP>
void run_reduce(DType t, const void* a, void* out, std::size_t rows, std::size_t size) {
  const int nt = num_threads();
  if (rows >= std::size_t(nt) || rows * size < kParallelMinElements) {
    // Enough rows to share out (or too little work to share at all): one row per task.
    const std::size_t grain = 1;
    const std::size_t threshold = size ? kParallelMinElements / size + 1 : rows + 1;
    parallel_range(rows, threshold, [&](std::size_t r0, std::size_t r1) {
      for (std::size_t r = r0; r < r1; ++r)
        store_value(t, out, r, reduce_span<OP>(t, a, r * size, (r + 1) * size));
    }, grain);
    return;
  }
  // Few long rows: split every row across the threads and combine their partial results.
  for (std::size_t r = 0; r < rows; ++r) {
    double partial[64];
    const int parts = nt < 64 ? nt : 64;
    for (int k = 0; k < parts; ++k) partial[k] = reduce_init<OP>();
    const std::size_t base = r * size;
    const std::size_t chunk = (size + parts - 1) / parts;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int k = 0; k < parts; ++k) {
      const std::size_t s = std::size_t(k) * chunk < size ? std::size_t(k) * chunk : size;
      const std::size_t e = s + chunk < size ? s + chunk : size;
      if (s < e) partial[k] = reduce_span<OP>(t, a, base + s, base + e);
    }
    double acc = reduce_init<OP>();
    for (int k = 0; k < parts; ++k) acc = combine<OP>(acc, partial[k]);
    store_value(t, out, r, acc);
  }
}

void reduce(RedOp op, DType t, const void* a, void* out, std::size_t rows, std::size_t size) {
  switch (op) {
    case RedOp::sum: return run_reduce<RedOp::sum>(t, a, out, rows, size);
    case RedOp::max: return run_reduce<RedOp::max>(t, a, out, rows, size);
    case RedOp::min: return run_reduce<RedOp::min>(t, a, out, rows, size);
  }
  throw std::invalid_argument("reduce: unknown op");
}

// Column sums: out[j] = the sum over i < m of a[i * n + j], the m rows of an (m, n) array
// added up (a linear layer's bias gradient, a sum over leading axes). Each column adds its
// rows in order in the element type (float for float16), as NumPy's own sum over axis 0
// does, so every path below gives the same bits. Narrow arrays (n < kSumStream) go kSumCols
// columns at a time with the partial sums in a local array of fixed size, which the
// compiler holds in vector registers (a loop of variable width kept them in memory, ~3x
// slower). Wider ones stream each row's next kSumChunk columns (contiguous) into partial
// sums kept in L1: reading 32 columns of every row instead jumps a whole row ahead per read
// and ran at ~0.6x NumPy. Whole blocks and chunks go to threads, so the result does not
// depend on the thread count. (Sums in double were 0.72x NumPy at one thread on float32.)
constexpr std::size_t kSumCols = 32;
constexpr std::size_t kSumChunk = 256;
constexpr std::size_t kSumStream = 256;

// bfloat16 elements as a type of their own (half_bits and bf16_bits are both uint16_t).
struct Bf16 { bf16_bits bits; };

template <class T> struct SumAcc { using type = T; };
template <> struct SumAcc<half_bits> { using type = float; };
template <> struct SumAcc<Bf16> { using type = float; };

template <class T>
inline typename SumAcc<T>::type sum_load(T v) {
  if constexpr (std::is_same_v<T, half_bits>) return half_to_float(v);
  else if constexpr (std::is_same_v<T, Bf16>) return bf16_to_float(v.bits);
  else return v;
}

template <class T>
inline T sum_store(typename SumAcc<T>::type v) {
  if constexpr (std::is_same_v<T, half_bits>) return float_to_half(v);
  else if constexpr (std::is_same_v<T, Bf16>) return Bf16{float_to_bf16(v)};
  else return v;
}

template <class T>
void sum_leading_full(const T* a, T* out, std::size_t m, std::size_t n) {
  typename SumAcc<T>::type acc[kSumCols] = {};
  for (std::size_t i = 0; i < m; ++i) {
    const T* r = a + i * n;
#pragma GCC unroll 32
    for (std::size_t k = 0; k < kSumCols; ++k) acc[k] += sum_load(r[k]);
  }
  for (std::size_t k = 0; k < kSumCols; ++k) out[k] = sum_store<T>(acc[k]);
}

// w <= kSumChunk columns from a, every row in turn (also the narrow path's last block).
// Four rows per pass over the partial sums, added one after the other (the same roundings
// as one row per pass), so the sums are loaded and stored a quarter as often.
template <class T>
void sum_leading_chunk(const T* a, T* out, std::size_t m, std::size_t n, std::size_t w) {
  typename SumAcc<T>::type acc[kSumChunk] = {};
  std::size_t i = 0;
  for (; i + 4 <= m; i += 4) {
    const T *r0 = a + i * n, *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
    for (std::size_t k = 0; k < w; ++k) {
      acc[k] = (((acc[k] + sum_load(r0[k])) + sum_load(r1[k])) + sum_load(r2[k])) +
               sum_load(r3[k]);
    }
  }
  for (; i < m; ++i) {
    const T* r = a + i * n;
    for (std::size_t k = 0; k < w; ++k) acc[k] += sum_load(r[k]);
  }
  for (std::size_t k = 0; k < w; ++k) out[k] = sum_store<T>(acc[k]);
}

template <class T>
void run_sum_leading(const T* a, T* out, std::size_t m, std::size_t n) {
  const bool stream = n >= kSumStream;
  const std::size_t width = stream ? kSumChunk : kSumCols;
  const std::size_t blocks = (n + width - 1) / width;
  const std::size_t per_block = m * width;
  parallel_range(blocks, kParallelMinElements / (per_block ? per_block : 1) + 1,
                 [&](std::size_t b0, std::size_t b1) {
                   for (std::size_t b = b0; b < b1; ++b) {
                     const std::size_t j = b * width, w = std::min(width, n - j);
                     if (!stream && w == kSumCols) sum_leading_full(a + j, out + j, m, n);
                     else sum_leading_chunk(a + j, out + j, m, n, w);
                   }
                 }, 1);
}

void sum_leading(DType t, const void* a, void* out, std::size_t m, std::size_t n) {
  if (t == DType::f32) {
    run_sum_leading(static_cast<const float*>(a), static_cast<float*>(out), m, n);
  } else if (t == DType::f64) {
    run_sum_leading(static_cast<const double*>(a), static_cast<double*>(out), m, n);
  } else if (t == DType::bf16) {
    run_sum_leading(static_cast<const Bf16*>(a), static_cast<Bf16*>(out), m, n);
  } else {
    run_sum_leading(static_cast<const half_bits*>(a), static_cast<half_bits*>(out), m, n);
  }
}
