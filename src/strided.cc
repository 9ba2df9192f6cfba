#include "strided.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace needle {

namespace {

std::string dims_str(const Dims& d) {
  std::string s = "(";
  for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

// Drops size-1 dims and merges neighbours that step through memory as one dim would, so
// compact views become one long row and the inner loop is as long as possible.
View simplify(const View& v) {
  View s{{}, {}, v.offset};
  for (std::size_t d = 0; d < v.shape.size(); ++d) {
    if (v.shape[d] == 1) continue;
    if (!s.shape.empty() && s.strides.back() == v.strides[d] * v.shape[d]) {
      s.shape.back() *= v.shape[d];
      s.strides.back() = v.strides[d];
    } else {
      s.shape.push_back(v.shape[d]);
      s.strides.push_back(v.strides[d]);
    }
  }
  if (s.shape.empty()) { s.shape.push_back(1); s.strides.push_back(1); }
  return s;
}

// Walks the simplified view as runs of rows: calls
//   rows(pos, count, row_stride, len, step, at)
// for `count` consecutive innermost rows of `len` elements `step` apart, the first starting at
// element offset `pos`, the next `row_stride` further on; `at` is the row-major index of the
// run's first element in the view. Runs are as long as the second-innermost dim allows, so
// short rows (im2col windows) do not pay the odometer once per row.
// `v` must be simplified.
template <class RowsFn>
void for_each_rows(const View& v, bool allow_parallel, RowsFn&& rows_fn) {
  const std::size_t nd = v.shape.size();
  const std::int64_t len = v.shape[nd - 1], step = v.strides[nd - 1];
  const std::int64_t inner_rows = nd >= 2 ? v.shape[nd - 2] : 1;
  const std::int64_t row_stride = nd >= 2 ? v.strides[nd - 2] : 0;
  std::size_t rows = 1;
  for (std::size_t d = 0; d + 1 < nd; ++d) rows *= std::size_t(v.shape[d]);
  const std::size_t threshold =
      allow_parallel ? kParallelMinElements / std::size_t(len) + 1 : ~std::size_t(0);
  parallel_range(rows, threshold, [&](std::size_t r0, std::size_t r1) {
    // Multi-index of row r0 over the outer dims, then step it like an odometer.
    Dims idx(nd, 0);
    std::int64_t pos = v.offset;
    std::size_t rest = r0;
    for (std::size_t d = nd - 1; d-- > 0;) {
      idx[d] = std::int64_t(rest % std::size_t(v.shape[d]));
      rest /= std::size_t(v.shape[d]);
      pos += idx[d] * v.strides[d];
    }
    for (std::size_t r = r0; r < r1;) {
      const std::int64_t in_dim = nd >= 2 ? inner_rows - idx[nd - 2] : 1;
      const std::int64_t count = std::min<std::int64_t>(in_dim, std::int64_t(r1 - r));
      rows_fn(pos, count, row_stride, len, step, std::int64_t(r) * len);
      r += std::size_t(count);
      if (nd < 2) break;
      idx[nd - 2] += count;
      pos += count * row_stride;
      // Carry into the outer dims once the second-innermost one wraps.
      for (std::size_t d = nd - 1; d-- > 0 && idx[d] >= v.shape[d];) {
        pos -= v.strides[d] * v.shape[d];
        idx[d] = 0;
        if (d == 0) break;
        pos += v.strides[d - 1];
        ++idx[d - 1];
      }
    }
  }, 1);
}

using I = std::int64_t;

// Tiles of the transposing path: kTile values of the contiguous dim j (one 64-byte line of
// float32 read per strided row) by kTileL values of the innermost dim. Measured on a 1024 x
// 1024 float32 transpose: 16 x 8 -> 12.9 GB/s, 8 x 8 -> 12.4, 16 x 16 -> 7.3, 32 x 32 -> 4.1:
// with power-of-two row strides every row of a tile maps to the same L1 set (8 ways), so the
// side walked with the large stride must stay at 8 rows.
constexpr I kTile = 16;
constexpr I kTileL = 8;

// Four consecutive values of the contiguous dim j (s[a], a < 4, at s + a) by values l0..l1
// of the strided innermost dim (s + l * step), to or from the compact side (c + a * cj + l).
// 4-byte elements go through 4 x 4 register transposes: four 16-byte loads and four stores
// per 16 values instead of sixteen of each (NCHW <-> NHWC of ResNet9's small feature maps ran
// at 0.66-0.84x NumPy on one thread element by element). The shuffles move bits, so any
// 4-byte type is copied exactly.
template <class U, bool kGather>
inline void move_quads(U* s, I step, U* c, I cj, I l0, I l1) {
  I l = l0;
#if defined(__SSE2__)
  static_assert(sizeof(U) == 4, "4-byte elements only");
  for (; l + 4 <= l1; l += 4) {
    if (kGather) {  // rows r[b] = (j0..j0+3, l + b) -> columns (j0 + a, l..l+3)
      __m128 r0 = _mm_loadu_ps(reinterpret_cast<const float*>(s + (l + 0) * step));
      __m128 r1 = _mm_loadu_ps(reinterpret_cast<const float*>(s + (l + 1) * step));
      __m128 r2 = _mm_loadu_ps(reinterpret_cast<const float*>(s + (l + 2) * step));
      __m128 r3 = _mm_loadu_ps(reinterpret_cast<const float*>(s + (l + 3) * step));
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
      _mm_storeu_ps(reinterpret_cast<float*>(c + 0 * cj + l), r0);
      _mm_storeu_ps(reinterpret_cast<float*>(c + 1 * cj + l), r1);
      _mm_storeu_ps(reinterpret_cast<float*>(c + 2 * cj + l), r2);
      _mm_storeu_ps(reinterpret_cast<float*>(c + 3 * cj + l), r3);
    } else {
      __m128 t0 = _mm_loadu_ps(reinterpret_cast<const float*>(c + 0 * cj + l));
      __m128 t1 = _mm_loadu_ps(reinterpret_cast<const float*>(c + 1 * cj + l));
      __m128 t2 = _mm_loadu_ps(reinterpret_cast<const float*>(c + 2 * cj + l));
      __m128 t3 = _mm_loadu_ps(reinterpret_cast<const float*>(c + 3 * cj + l));
      _MM_TRANSPOSE4_PS(t0, t1, t2, t3);
      _mm_storeu_ps(reinterpret_cast<float*>(s + (l + 0) * step), t0);
      _mm_storeu_ps(reinterpret_cast<float*>(s + (l + 1) * step), t1);
      _mm_storeu_ps(reinterpret_cast<float*>(s + (l + 2) * step), t2);
      _mm_storeu_ps(reinterpret_cast<float*>(s + (l + 3) * step), t3);
    }
  }
#endif
  for (; l < l1; ++l) {
    for (I a = 0; a < 4; ++a) {
      if (kGather) c[a * cj + l] = s[a + l * step];
      else s[a + l * step] = c[a * cj + l];
    }
  }
}

// Views whose innermost dimension is strided (a transpose, NHWC <-> NCHW) while another
// dimension `j` is contiguous in memory. Walking them row by row reads one element per cache
// line; moving tiles of (j, innermost) instead reads and writes whole lines. Work items
// are (index over the other dims, block of kTile values of j). Returns false when the view is
// not of this kind. kGather: compact <- view, else view <- compact (no repeated positions).
template <class U, bool kGather>
bool move_tiles(const View& v, U* strided, U* compact) {
  const std::size_t nd = v.shape.size();
  const I len = v.shape[nd - 1], step = v.strides[nd - 1];
  if (nd < 2 || step == 1 || step == 0 || len < kTile) return false;
  std::size_t j = nd;
  for (std::size_t d = 0; d + 1 < nd && j == nd; ++d) {
    if (v.strides[d] == 1 && v.shape[d] >= kTile) j = d;
  }
  if (j == nd) return false;
  Dims cstride(nd);  // strides of the compact side
  I acc = 1;
  for (std::size_t d = nd; d-- > 0;) { cstride[d] = acc; acc *= v.shape[d]; }
  const I nj = v.shape[j], cj = cstride[j];
  const std::size_t blocks = std::size_t((nj + kTile - 1) / kTile);
  std::size_t planes = 1;
  for (std::size_t d = 0; d + 1 < nd; ++d) if (d != j) planes *= std::size_t(v.shape[d]);
  const std::size_t threshold = kParallelMinElements / std::size_t(kTile * len) + 1;
  parallel_range(planes * blocks, threshold, [&](std::size_t i0, std::size_t i1) {
    for (std::size_t item = i0; item < i1; ++item) {
      std::size_t rest = item / blocks;
      I so = v.offset, co = 0;
      for (std::size_t d = nd - 1; d-- > 0;) {
        if (d == j) continue;
        const I idx = I(rest % std::size_t(v.shape[d]));
        rest /= std::size_t(v.shape[d]);
        so += idx * v.strides[d];
        co += idx * cstride[d];
      }
      const I j0 = I(item % blocks) * kTile, j1 = std::min(nj, j0 + kTile);
      for (I l0 = 0; l0 < len; l0 += kTileL) {
        const I l1 = std::min(len, l0 + kTileL);
        I jj = j0;
        if constexpr (sizeof(U) == 4) {
          for (; jj + 4 <= j1; jj += 4) {
            move_quads<U, kGather>(strided + so + jj, step, compact + co + jj * cj, cj, l0, l1);
          }
        }
        for (; jj < j1; ++jj) {
          U* s = strided + so + jj;
          U* c = compact + co + jj * cj;
          for (I l = l0; l < l1; ++l) {
            if (kGather) c[l] = s[l * step];
            else s[l * step] = c[l];
          }
        }
      }
    }
  }, 1);
  return true;
}

// Gathers of views whose innermost dim holds 2 or 3 values far apart while the next dim is
// contiguous: an NCHW batch of RGB images viewed as NHWC, which conv's first layer compacts.
// Row by row that is one element per step; here four consecutive values of the contiguous
// dim are loaded from each of the 2-3 rows, transposed in registers and stored as 4 x len
// contiguous values (whole 4-wide stores that overlap: each writes up to two values past its
// own, which the next store in the same block rewrites; the block's last quads go one by
// one). 1 thread: conv1's (128, 3, 32, 32) input 263 -> 101 us.
constexpr I kNarrowBlock = 256;  // values of the contiguous dim per work item

template <class U>
bool gather_narrow(const View& v, const U* src, U* out) {
#if defined(__SSE2__)
  if constexpr (sizeof(U) == 4) {
    const std::size_t nd = v.shape.size();
    if (nd < 2) return false;
    const I len = v.shape[nd - 1], step = v.strides[nd - 1], nj = v.shape[nd - 2];
    if (len < 2 || len > 3 || v.strides[nd - 2] != 1 || nj < 8) return false;
    std::size_t planes = 1;
    for (std::size_t d = 0; d + 2 < nd; ++d) planes *= std::size_t(v.shape[d]);
    const std::size_t blocks = std::size_t((nj + kNarrowBlock - 1) / kNarrowBlock);
    const std::size_t threshold = kParallelMinElements / std::size_t(kNarrowBlock * len) + 1;
    parallel_range(planes * blocks, threshold, [&](std::size_t i0, std::size_t i1) {
      for (std::size_t item = i0; item < i1; ++item) {
        const std::size_t plane = item / blocks;
        std::size_t rest = plane;
        I so = v.offset;
        for (std::size_t d = nd - 2; d-- > 0;) {
          so += I(rest % std::size_t(v.shape[d])) * v.strides[d];
          rest /= std::size_t(v.shape[d]);
        }
        const U* su = src + so;
        U* cu = out + I(plane) * nj * len;
        const float* s = reinterpret_cast<const float*>(su);  // for the intrinsics only
        float* c = reinterpret_cast<float*>(cu);
        const I j0 = I(item % blocks) * kNarrowBlock, j1 = std::min(nj, j0 + kNarrowBlock);
        I jj = j0;
        for (; jj + 8 <= j1; jj += 4) {  // quads with one more quad after them in the block
          __m128 r0 = _mm_loadu_ps(s + jj), r1 = _mm_loadu_ps(s + step + jj);
          __m128 r2 = len == 3 ? _mm_loadu_ps(s + 2 * step + jj) : _mm_setzero_ps();
          __m128 r3 = _mm_setzero_ps();
          _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
          _mm_storeu_ps(c + (jj + 0) * len, r0);
          _mm_storeu_ps(c + (jj + 1) * len, r1);
          _mm_storeu_ps(c + (jj + 2) * len, r2);
          _mm_storeu_ps(c + (jj + 3) * len, r3);
        }
        for (; jj < j1; ++jj) {
          for (I l = 0; l < len; ++l) cu[jj * len + l] = su[jj + l * step];
        }
      }
    }, 1);
    return true;
  }
#endif
  (void)v, (void)src, (void)out;
  return false;
}

template <class U>
void gather_t(const U* src, const View& view, U* out) {
  const View v = simplify(view);
  if (gather_narrow(v, src, out)) return;
  if (move_tiles<U, true>(v, const_cast<U*>(src), out)) return;
  for_each_rows(v, true, [&](I pos, I count, I rstride, I len, I step, I at) {
    U* o = out + at;
    for (I r = 0; r < count; ++r, o += len) {
      const U* s = src + pos + r * rstride;
      if (step == 1 && len >= 16) {
        std::memcpy(o, s, std::size_t(len) * sizeof(U));
      } else if (step == 0) {  // broadcast along the row: a fill
        const U value = s[0];
        for (I i = 0; i < len; ++i) o[i] = value;
      } else {
        for (I i = 0; i < len; ++i) o[i] = s[i * step];
      }
    }
  });
}

template <class U>
void scatter_t(const U* src, const View& view, U* dst, bool parallel) {
  const View v = simplify(view);
  if (parallel && move_tiles<U, false>(v, dst, const_cast<U*>(src))) return;
  for_each_rows(v, parallel, [&](I pos, I count, I rstride, I len, I step, I at) {
    const U* s = src + at;
    for (I r = 0; r < count; ++r, s += len) {
      U* d = dst + pos + r * rstride;
      if (step == 1 && len >= 16) {
        std::memcpy(d, s, std::size_t(len) * sizeof(U));
      } else {
        for (I i = 0; i < len; ++i) d[i * step] = s[i];
      }
    }
  });
}

template <class U>
void scatter_value_t(U value, const View& view, U* dst) {
  for_each_rows(simplify(view), true, [&](I pos, I count, I rstride, I len, I step, I) {
    for (I r = 0; r < count; ++r) {
      U* d = dst + pos + r * rstride;
      for (I i = 0; i < len; ++i) d[i * step] = value;
    }
  });
}

// A destination view with a 0 stride writes some elements several times; NumPy keeps the
// last write, so such views are scattered in order on one thread.
bool has_repeats(const View& v) {
  for (std::size_t d = 0; d < v.shape.size(); ++d)
    if (v.strides[d] == 0 && v.shape[d] > 1) return true;
  return false;
}

}  // namespace

std::size_t check_view(const char* op, const View& v, std::size_t buffer_size) {
  const auto describe = [&] {
    return " for shape " + dims_str(v.shape) + ", strides " + dims_str(v.strides) +
           ", offset " + std::to_string(v.offset);
  };
  if (v.shape.size() != v.strides.size()) {
    throw ShapeArgError(std::string(op) + ": shape and strides differ in length, got " +
                        dims_str(v.shape) + " and " + dims_str(v.strides));
  }
  bool empty = false;
  for (const std::int64_t n : v.shape) {
    if (n < 0) {
      throw ShapeArgError(std::string(op) + ": negative dimension in shape " +
                          dims_str(v.shape));
    }
    if (n > kMaxViewElements) {
      throw SizeLimitError(std::string(op) + ": dimension too large, expected every dim <= " +
                           std::to_string(kMaxViewElements) + " (2**62)" + describe());
    }
    empty = empty || n == 0;
  }
  if (v.offset < 0) {
    throw BoundsError(std::string(op) + ": offset must be >= 0, got " +
                      std::to_string(v.offset));
  }
  if (empty) return 0;  // no element is read or written, whatever the strides
  // Every product and sum is checked: a wrapped count or extent would let a view that reaches
  // far outside the buffer pass as a small one.
  std::int64_t count = 1, lo = v.offset, hi = v.offset;
  bool count_overflow = false, reach_overflow = false;
  for (std::size_t d = 0; d < v.shape.size(); ++d) {
    count_overflow = count_overflow || mul_overflows(count, v.shape[d], &count);
    std::int64_t reach = 0;
    if (mul_overflows(v.shape[d] - 1, v.strides[d], &reach) ||
        add_overflows(reach < 0 ? lo : hi, reach, reach < 0 ? &lo : &hi)) {
      reach_overflow = true;
    }
  }
  if (count_overflow || count > kMaxViewElements) {
    throw SizeLimitError(std::string(op) + ": view too large, expected at most " +
                         std::to_string(kMaxViewElements) + " elements (2**62), got more" +
                         describe());
  }
  if (reach_overflow || lo < 0 || hi >= std::int64_t(buffer_size)) {
    throw BoundsError(std::string(op) + ": view reaches outside its buffer, expected " +
                      "element offsets in [0, " + std::to_string(buffer_size) + "), got " +
                      (reach_overflow ? std::string("an offset beyond int64")
                                      : "[" + std::to_string(lo) + ", " + std::to_string(hi) +
                                            "]") +
                      describe());
  }
  return std::size_t(count);
}

#define NEEDLE_BY_SIZE(bytes, CALL)                    \
  switch (bytes) {                                     \
    case 2: CALL(std::uint16_t); break;                \
    case 4: CALL(std::uint32_t); break;                \
    case 8: CALL(std::uint64_t); break;                \
    default: throw std::invalid_argument("bad element size"); \
  }

void gather(std::size_t elem_bytes, const void* src, const View& v, void* out) {
#define NEEDLE_CALL(U) gather_t(static_cast<const U*>(src), v, static_cast<U*>(out))
  NEEDLE_BY_SIZE(elem_bytes, NEEDLE_CALL)
#undef NEEDLE_CALL
}

void scatter(std::size_t elem_bytes, const void* src, const View& v, void* dst) {
  const bool parallel = !has_repeats(v);
#define NEEDLE_CALL(U) scatter_t(static_cast<const U*>(src), v, static_cast<U*>(dst), parallel)
  NEEDLE_BY_SIZE(elem_bytes, NEEDLE_CALL)
#undef NEEDLE_CALL
}

void scatter_value(std::size_t elem_bytes, const void* value, const View& v, void* dst) {
#define NEEDLE_CALL(U)                          \
  {                                             \
    U bits;                                     \
    std::memcpy(&bits, value, sizeof(U));       \
    scatter_value_t(bits, v, static_cast<U*>(dst)); \
  }
  NEEDLE_BY_SIZE(elem_bytes, NEEDLE_CALL)
#undef NEEDLE_CALL
}

}  // namespace needle
