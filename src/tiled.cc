#include "tiled.h"

#include <cstring>

#include "allocator.h"
#include "strided.h"

namespace needle {

namespace {

// The course algorithm: zero each output tile, then accumulate tile products over k.
template <class T>
void tiled_loops(const T* a, const T* b, T* out, std::size_t m, std::size_t n, std::size_t p,
                 std::size_t tile) {
  const std::size_t mt = m / tile, nt = n / tile, pt = p / tile, tt = tile * tile;
  for (std::size_t i = 0; i < mt; ++i) {
    for (std::size_t j = 0; j < pt; ++j) {
      T* o = out + (i * pt + j) * tt;
      std::memset(o, 0, tt * sizeof(T));
      for (std::size_t k = 0; k < nt; ++k) {
        const T* at = a + (i * nt + k) * tt;
        const T* bt = b + (k * pt + j) * tt;
        for (std::size_t r = 0; r < tile; ++r)
          for (std::size_t kk = 0; kk < tile; ++kk) {
            const T av = at[r * tile + kk];
#pragma omp simd
            for (std::size_t c = 0; c < tile; ++c) o[r * tile + c] += av * bt[kk * tile + c];
          }
      }
    }
  }
}

// The view of a tiled (rows/T, cols/T, T, T) buffer as a rows x cols row-major matrix.
View tiled_as_matrix(std::size_t rows, std::size_t cols, std::size_t tile) {
  const auto T = std::int64_t(tile), R = std::int64_t(rows), C = std::int64_t(cols);
  return View{{R / T, T, C / T, T}, {(C / T) * T * T, T, T * T, 1}, 0};
}

}  // namespace

void matmul_tiled(const KernelTable& k, DType t, const void* a, const void* b, void* out,
                  std::size_t m, std::size_t n, std::size_t p, std::size_t tile) {
  const double flops = 2.0 * double(m) * double(n) * double(p);
  if (t == DType::f32 && flops < 1e6) {
    return tiled_loops(static_cast<const float*>(a), static_cast<const float*>(b),
                       static_cast<float*>(out), m, n, p, tile);
  }
  if (t == DType::f64 && flops < 1e6) {
    return tiled_loops(static_cast<const double*>(a), static_cast<const double*>(b),
                       static_cast<double*>(out), m, n, p, tile);
  }
  // Large products (and float16): untile into row-major scratch, use the packed kernel,
  // tile the result. The copies are O(n^2) against O(n^3) arithmetic.
  const std::size_t es = itemsize(t);
  char* scratch = static_cast<char*>(needle_alloc((m * n + n * p + m * p) * es));
  char* am = scratch;
  char* bm = am + m * n * es;
  char* cm = bm + n * p * es;
  try {
    // Gathering the "matrix view" of a tiled buffer yields row-major order.
    gather(es, a, tiled_as_matrix(m, n, tile), am);
    gather(es, b, tiled_as_matrix(n, p, tile), bm);
    k.matmul(t, am, bm, cm, m, n, p);
    scatter(es, cm, tiled_as_matrix(m, p, tile), out);
  } catch (...) {
    needle_free(scratch);
    throw;
  }
  needle_free(scratch);
}

}  // namespace needle
