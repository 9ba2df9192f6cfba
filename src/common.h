// Shared definitions of the C++ CPU backend: dtypes, float16/bfloat16 conversion, threading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace needle {

enum class DType : int { f32 = 0, f64 = 1, f16 = 2, bf16 = 3 };

// ---- limits and the errors of the entry points' checks --------------------------------------

// The largest buffer (bytes) and the largest view (elements): below these every element
// offset, count and byte count the kernels compute is exact in int64_t / size_t arithmetic.
// needle/backend_ndarray/ndarray_limits.py checks the same limits first (docs/limits.md).
constexpr std::size_t kMaxBufferBytes = std::size_t(1) << 62;
constexpr std::int64_t kMaxViewElements = std::int64_t(1) << 62;

// Thrown by the checks of the module's entry points; the module translates each one into the
// needle._core.errors class named in its comment, so that no bad call reaches a kernel.
struct SizeLimitError : std::length_error {  // SizeLimitError (a ShapeError, ValueError)
  using std::length_error::length_error;
};
struct BoundsError : std::out_of_range {  // IndexOutOfRange (an IndexError)
  using std::out_of_range::out_of_range;
};
struct ShapeArgError : std::invalid_argument {  // ShapeError (a ValueError)
  using std::invalid_argument::invalid_argument;
};
struct OutOfMemory : std::runtime_error {  // OutOfMemoryError (a MemoryError)
  using std::runtime_error::runtime_error;
};

// a * b and a + b that report overflow of int64 instead of wrapping.
static inline bool mul_overflows(std::int64_t a, std::int64_t b, std::int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
static inline bool add_overflows(std::int64_t a, std::int64_t b, std::int64_t* out) {
  return __builtin_add_overflow(a, b, out);
}

// The helpers below are `static inline`: kernels_avx2.cc compiles them with AVX2 enabled, and
// with plain `inline` the linker could keep that copy for the baseline code as well.

// float16 and bfloat16 are stored as their 16 raw bits; kernels convert to float32, compute
// and round back.
using half_bits = std::uint16_t;
using bf16_bits = std::uint16_t;

// The two-byte dtypes, computed in float32.
static inline bool is_low_precision(DType t) { return t == DType::f16 || t == DType::bf16; }

static inline std::size_t itemsize(DType t) {
  return t == DType::f64 ? 8 : (t == DType::f32 ? 4 : 2);
}

static inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f64: return "float64";
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "unknown";
}

static inline DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "float64") return DType::f64;
  if (name == "float16") return DType::f16;
  if (name == "bfloat16") return DType::bf16;
  throw std::invalid_argument(
      "Array: unknown dtype, expected float32, float64, float16 or bfloat16, got " + name);
}

// ---- float16 <-> float conversion (IEEE binary16, round to nearest even) -------------------

static inline float half_to_float(half_bits h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    std::uint32_t e = 113;
    while ((mant & 0x400u) == 0) { mant <<= 1; --e; }
    bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Rounds a double straight to a two-byte binary format with `Frac` fraction bits and exponent
// bias `Bias` (binary16: 10, 15; bfloat16: 7, 127), to nearest even, with no intermediate
// float and so no double rounding. NaN stays a quiet NaN of the same sign.
template <int Frac, int Bias>
static inline std::uint16_t double_to_small(double d) {
  constexpr std::uint32_t inf = std::uint32_t(2 * Bias + 1) << Frac;
  constexpr int emin = 1 - Bias;  // exponent of the smallest normal
  std::uint64_t bits;
  std::memcpy(&bits, &d, 8);
  const std::uint16_t sign = std::uint16_t((bits >> 48) & 0x8000u);
  const int exp = int((bits >> 52) & 0x7ff);
  const std::uint64_t mant = bits & 0xfffffffffffffull;
  if (exp == 0x7ff) return std::uint16_t(sign | (mant ? inf | (1u << (Frac - 1)) : inf));
  const int e = exp - 1023;  // unbiased exponent
  if (e > Bias) return std::uint16_t(sign | inf);
  // Significand with the implicit bit, then the number of low bits to drop so that the
  // result has Frac fraction bits (more for subnormals, whose exponent is fixed at emin).
  const std::uint64_t sig = mant | (std::uint64_t(exp != 0) << 52);
  const int shift = 52 - Frac + (e < emin ? (emin - e) : 0);
  if (shift > 53 + Frac) return sign;  // far below the smallest subnormal: rounds to zero
  std::uint64_t kept = sig >> shift;
  const std::uint64_t rem = sig & ((std::uint64_t(1) << shift) - 1);
  const std::uint64_t halfway = std::uint64_t(1) << (shift - 1);
  if (rem > halfway || (rem == halfway && (kept & 1))) ++kept;
  // For normals `kept` carries the implicit bit at 1<<Frac; adding the biased exponent - 1
  // places it correctly, and a mantissa carry rolls into the exponent as IEEE requires.
  std::uint32_t out = std::uint32_t(kept);
  if (e >= emin) out += std::uint32_t(e - emin) << Frac;
  if (out >= inf) out = inf;
  return std::uint16_t(sign | out);
}

static inline half_bits double_to_half(double d) { return double_to_small<10, 15>(d); }
static inline half_bits float_to_half(float f) { return double_to_half(double(f)); }

// ---- bfloat16 <-> float conversion (the top half of a float32, round to nearest even) --------

static inline float bf16_to_float(bf16_bits h) {
  const std::uint32_t bits = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline bf16_bits float_to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16_bits((bits >> 16) | 0x0040u);  // quiet
  // adding 0x7fff plus the lowest kept bit carries exactly when the dropped half rounds up
  // (ties to even); a carry out of the largest finite value lands on infinity
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16_bits(bits >> 16);
}

static inline bf16_bits double_to_bf16(double d) { return double_to_small<7, 127>(d); }

// ---- threading --------------------------------------------------------------------------

// Element counts below which a kernel stays on the calling thread: forking a team costs
// microseconds and, on the 2-core machines measured, a second core pays off only above
// ~1e5-1e6 elements or ~1e7 flop (docs/performance.md).
constexpr std::size_t kParallelMinElements = 100000;      // memory-bound loops
constexpr std::size_t kParallelMinHeavyElements = 16384;  // exp/tanh/log/pow: compute-bound

// Flops below which a matrix product or convolution stays on the calling thread: 2e6 when
// libgomp's idle workers sleep after a short spin (a product then pays ~40 us to wake one on
// the project's VMs), 5e5 when they spin long enough for back-to-back kernels to find them
// awake (threads.cc reads that from the environment libgomp was loaded with).
double parallel_min_flops();

int num_threads();
void set_num_threads(int n);

// Calls fn(begin, end) on disjoint ranges covering [0, n), on up to num_threads() threads
// when n >= threshold; ranges are multiples of `grain` so SIMD loops see aligned blocks.
template <class Fn>
void parallel_range(std::size_t n, std::size_t threshold, Fn&& fn, std::size_t grain = 64) {
  const int nt = num_threads();
#ifdef _OPENMP
  if (nt > 1 && n >= threshold) {
#pragma omp parallel num_threads(nt)
    {
      const std::size_t teams = std::size_t(omp_get_num_threads());
      const std::size_t t = std::size_t(omp_get_thread_num());
      std::size_t chunk = (n + teams - 1) / teams;
      chunk = (chunk + grain - 1) / grain * grain;
      const std::size_t begin = t * chunk < n ? t * chunk : n;
      const std::size_t end = begin + chunk < n ? begin + chunk : n;
      if (begin < end) fn(begin, end);
    }
    return;
  }
#endif
  (void)nt;
  (void)threshold;
  (void)grain;
  if (n) fn(std::size_t(0), n);
}

}  // namespace needle
