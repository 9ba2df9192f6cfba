// The compute kernels, built twice: once for baseline x86-64 (namespace `base`) and once with
// AVX2+FMA+F16C enabled for that translation unit only (namespace `avx2`). The bindings pick
// one table at import time with __builtin_cpu_supports, so no -march=native is needed.
#pragma once

#include <cstddef>

#include "common.h"

namespace needle {

enum class BinOp : int { add, sub, mul, div, maximum, minimum, power, eq, ge };
enum class UnOp : int { neg, log, exp, tanh, sqrt, abs, sign, sigmoid };
enum class RedOp : int { sum, max, min };

struct KernelTable {
  const char* name;
  // out[i] = op(a[i], b[i]); all three arrays of dtype `t`, `n` elements.
  void (*binary)(BinOp op, DType t, const void* a, const void* b, void* out, std::size_t n);
  // out[i] = op(a[i], val), or op(val, a[i]) when `reversed`.
  void (*scalar)(BinOp op, bool reversed, DType t, const void* a, double val, void* out,
                 std::size_t n);
  void (*unary)(UnOp op, DType t, const void* a, void* out, std::size_t n);
  void (*cast)(DType from, const void* a, DType to, void* out, std::size_t n);
  // out[r] = op(a[r*size .. r*size+size)) for r < rows.
  void (*reduce)(RedOp op, DType t, const void* a, void* out, std::size_t rows, std::size_t size);
  // out(m x p) = a(m x n) @ b(n x p), row-major, overwrites out.
  void (*matmul)(DType t, const void* a, const void* b, void* out, std::size_t m, std::size_t n,
                 std::size_t p);
  // The same with strided operands: a(i, k) = a[i * ars + k * acs], b(k, j) = b[k * brs +
  // j * bcs] (float32/float64).
  void (*matmul_strided)(DType t, const void* a, std::ptrdiff_t ars, std::ptrdiff_t acs,
                         const void* b, std::ptrdiff_t brs, std::ptrdiff_t bcs, void* out,
                         std::size_t m, std::size_t n, std::size_t p);
};

namespace base { extern const KernelTable table; }
#if defined(__x86_64__) || defined(_M_X64)
namespace avx2 { extern const KernelTable table; }
#define NEEDLE_HAVE_AVX2_TABLE 1
#endif

}  // namespace needle
