// 2-D convolution (NHWC input, (KH, KW, Cin, Cout) kernel) without a materialised im2col
// matrix. Included inside `namespace needle::<isa>` by kernels_impl.h, after matmul_impl.h.
//
// Every kernel walks the output pixels in chunks. A chunk's im2col rows (one row of
// KH*KW*Cin values per output pixel, zeros where the window leaves the input) are built in a
// per-thread scratch that stays in L2, and the packed matmul runs on that scratch:
//
//   forward      out[chunk]   = rows @ W                    (W: K x Cout, read in place)
//   weight grad  dW          += rows^T @ dY[chunk]           (per-thread partial dW, summed)
//   input grad   dX[chunk]  <-+ col2im(dY[chunk] @ W^T)      (scatter-add, images split
//                                                             between threads: no races)
//
// so the full im2col matrix (for ResNet9's first layer 4.8 MB per batch) is never written to
// or read back from memory, and padding costs nothing (no padded copy of the input).

// ConvGeom (kernels.h) describes the geometry; the bindings have checked it against the
// buffers.

// Pixels per chunk: a multiple of 24 (the row tile of the widest micro-kernel) whose im2col
// rows take about 192 KiB.
inline std::size_t conv_chunk(const ConvGeom& g, std::size_t item) {
  std::size_t rows = (std::size_t(192) << 10) / (g.k() * item);
  rows = rows < 24 ? 24 : (rows > 1536 ? 1536 : rows);
  return rows / 24 * 24;
}

// dst[0..len) = src[0..len) and zero fills for im2col rows, which are written front to back:
// the last vector of a run is stored whole (zeros past `len`, from a masked load), spilling
// up to one vector into what is written next (or into the scratch's slack). Masked stores
// would be exact but cost several times a plain store on some CPUs (AMD Zen 4).
template <class T>
inline void copy_run(T* dst, const T* src, std::size_t len) {
#if defined(__AVX2__) && defined(__FMA__)
  using Z = Vec<T>;
  std::size_t i = 0;
  for (; i + Z::W <= len; i += Z::W) Z::storeu(dst + i, Z::loadu(src + i));
  if (i < len) Z::storeu(dst + i, Z::load_mask(src + i, Z::mask(int(len - i))));
#else
  std::memcpy(dst, src, len * sizeof(T));
#endif
}

template <class T>
inline void zero_run(T* dst, std::size_t len) {
#if defined(__AVX2__) && defined(__FMA__)
  using Z = Vec<T>;
  for (std::size_t i = 0; i < len; i += Z::W) Z::storeu(dst + i, Z::zero());
#else
  std::memset(dst, 0, len * sizeof(T));
#endif
}

template <class T>
inline void add_run(T* dst, const T* src, std::size_t len) {
#pragma omp simd
  for (std::size_t i = 0; i < len; ++i) dst[i] += src[i];
}

// dst[j * c + ch] = src[ch * sc + j] for j < len, ch < c: channel planes (sc apart) to
// pixel rows of c values. float32 moves 4 x 4 blocks through a register transpose (four
// loads and four stores per 16 values), the rest one by one.
template <class T>
void planes_to_rows(const T* src, std::size_t sc, std::size_t len, std::size_t c, T* dst) {
  std::size_t c4 = 0;
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 4) {
    const std::size_t len4 = len / 4 * 4;
    for (; c4 + 4 <= c; c4 += 4) {
      const float* p = reinterpret_cast<const float*>(src + c4 * sc);
      float* d = reinterpret_cast<float*>(dst + c4);
      for (std::size_t j = 0; j < len4; j += 4) {
        __m128 r0 = _mm_loadu_ps(p + j), r1 = _mm_loadu_ps(p + sc + j);
        __m128 r2 = _mm_loadu_ps(p + 2 * sc + j), r3 = _mm_loadu_ps(p + 3 * sc + j);
        _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
        _mm_storeu_ps(d + j * c, r0);
        _mm_storeu_ps(d + (j + 1) * c, r1);
        _mm_storeu_ps(d + (j + 2) * c, r2);
        _mm_storeu_ps(d + (j + 3) * c, r3);
      }
      for (std::size_t j = len4; j < len; ++j)
        for (std::size_t a = 0; a < 4; ++a) dst[j * c + c4 + a] = src[(c4 + a) * sc + j];
    }
  }
#endif
  for (std::size_t ch = c4; ch < c; ++ch) {
    const T* plane = src + ch * sc;
    for (std::size_t j = 0; j < len; ++j) dst[j * c + ch] = plane[j];
  }
}

// dst[j * c + ch] = src[j * sw + ch * sc] for j < w, ch < c: one image row of a strided
// operand (an NCHW tensor seen as NHWC: sw = 1, sc = H * W) laid out as NHWC. Exact (no
// spill past dst's w * c values).
template <class T>
void gather_row(const T* src, std::size_t sw, std::size_t sc, std::size_t w, std::size_t c,
                T* dst) {
  if (sc == 1 && sw == c) {
    std::memcpy(dst, src, w * c * sizeof(T));
  } else if (c == 3 && sw == 1) {  // RGB planes: a 3-way interleave, which GCC vectorises
    const T *r = src, *gr = src + sc, *b = src + 2 * sc;
    for (std::size_t j = 0; j < w; ++j) {
      dst[3 * j] = r[j];
      dst[3 * j + 1] = gr[j];
      dst[3 * j + 2] = b[j];
    }
  } else if (sw == 1) {
    planes_to_rows(src, sc, w, c, dst);
  } else {
    for (std::size_t j = 0; j < w; ++j)
      for (std::size_t ch = 0; ch < c; ++ch) dst[j * c + ch] = src[j * sw + ch * sc];
  }
}

// dst (h x w x c, compact) = image `src` of a strided operand (strides s over N, H, W, C).
// Channel planes of whole images (NCHW) move as one planes_to_rows of h * w pixels. For one
// image inside a kernel's parallel region (the direct kernel gradient's dy), where the
// strided-copy kernel (CompactCopy) would start threads of its own.
template <class T>
void gather_image(const T* src, const std::size_t (&s)[4], std::size_t h, std::size_t w,
                  std::size_t c, T* dst) {
  if (s[2] == 1 && s[1] == w && c != 3) return planes_to_rows(src, s[3], h * w, c, dst);
  for (std::size_t i = 0; i < h; ++i) {
    gather_row(src + i * s[1], s[2], s[3], w, c, dst + i * w * c);
  }
}

// A compact NHWC copy of a strided operand (n images of h x w x c), for the kernel paths that
// read their operand in place: the strided-copy kernel of NDArray.compact (strided.h), which
// already moves NCHW <-> NHWC in register-transposed tiles, in parallel. Owns its buffer.
template <class T>
struct CompactCopy {
  T* data;
  CompactCopy(const T* src, const std::size_t (&s)[4], std::size_t n, std::size_t h,
              std::size_t w, std::size_t c)
      : data(static_cast<T*>(needle_alloc(n * h * w * c * sizeof(T)))) {
    const View view{{std::int64_t(n), std::int64_t(h), std::int64_t(w), std::int64_t(c)},
                    {std::int64_t(s[0]), std::int64_t(s[1]), std::int64_t(s[2]),
                     std::int64_t(s[3])},
                    0};
    needle::gather(sizeof(T), src, view, data);
  }
  ~CompactCopy() { needle_free(data); }
  CompactCopy(const CompactCopy&) = delete;
  CompactCopy& operator=(const CompactCopy&) = delete;
};

// g with x (or dy) made compact NHWC: the geometry of a CompactCopy of it.
inline ConvGeom with_compact_x(ConvGeom g) {
  g.set_compact_x();
  return g;
}

inline ConvGeom with_compact_dy(ConvGeom g) {
  g.set_compact_dy();
  return g;
}

// The window of output pixel `pixel`: its image, the input row/col of its top-left tap (may
// be negative) and the range of kernel columns [kw_lo, kw_hi) that fall inside the input.
struct Window {
  std::size_t n;
  std::ptrdiff_t hi0, wi0;
  std::size_t kw_lo, kw_hi;
};

inline Window window_of(const ConvGeom& g, std::size_t pixel) {
  Window win;
  const std::size_t per_image = g.ho * g.wo;
  win.n = pixel / per_image;
  const std::size_t rem = pixel % per_image, oh = rem / g.wo, ow = rem % g.wo;
  win.hi0 = std::ptrdiff_t(oh * g.stride) - std::ptrdiff_t(g.pad);
  win.wi0 = std::ptrdiff_t(ow * g.stride) - std::ptrdiff_t(g.pad);
  const std::ptrdiff_t lo = -win.wi0, hi = std::ptrdiff_t(g.w) - win.wi0;
  win.kw_lo = lo > 0 ? std::size_t(lo) : 0;
  win.kw_hi = hi < std::ptrdiff_t(g.kw) ? (hi > 0 ? std::size_t(hi) : 0) : g.kw;
  if (win.kw_hi < win.kw_lo) win.kw_hi = win.kw_lo;
  return win;
}

// Rows [0, count) of dst (row stride ldd) = the im2col rows of pixels [first, first + count).
template <class T>
void im2col_rows(const T* x, const ConvGeom& g, std::size_t first, std::size_t count, T* dst,
                 std::size_t ldd) {
  const std::size_t seg = g.kw * g.c;  // one kernel row: KW * Cin values, contiguous in x
  const std::size_t row_stride = g.w * g.c;
  for (std::size_t i = 0; i < count; ++i) {
    const Window win = window_of(g, first + i);
    T* row = dst + i * ldd;
    const std::size_t lo = win.kw_lo * g.c, len = (win.kw_hi - win.kw_lo) * g.c;
    const T* src = x + win.n * g.h * row_stride +
                   std::ptrdiff_t(win.wi0 + std::ptrdiff_t(win.kw_lo)) * std::ptrdiff_t(g.c);
    for (std::size_t a = 0; a < g.kh; ++a, row += seg) {
      const std::ptrdiff_t hi = win.hi0 + std::ptrdiff_t(a);
      if (hi < 0 || hi >= std::ptrdiff_t(g.h) || len == 0) {
        zero_run(row, seg);
        continue;
      }
      if (lo) zero_run(row, lo);
      copy_run(row + lo, src + std::size_t(hi) * row_stride, len);
      if (lo + len < seg) zero_run(row + lo + len, seg - lo - len);
    }
  }
}

// dx[pixels' windows] += rows (the inverse of im2col_rows, accumulating; out-of-input taps
// are dropped).
template <class T>
void col2im_rows_add(const T* rows, std::size_t ldr, const ConvGeom& g, std::size_t first,
                     std::size_t count, T* dx) {
  const std::size_t seg = g.kw * g.c;
  for (std::size_t i = 0; i < count; ++i) {
    const Window win = window_of(g, first + i);
    const T* row = rows + i * ldr;
    T* image = dx + win.n * g.h * g.w * g.c;
    for (std::size_t a = 0; a < g.kh; ++a, row += seg) {
      const std::ptrdiff_t hi = win.hi0 + std::ptrdiff_t(a);
      if (hi < 0 || hi >= std::ptrdiff_t(g.h) || win.kw_lo == win.kw_hi) continue;
      T* dst = image + (std::size_t(hi) * g.w + std::size_t(win.wi0 + std::ptrdiff_t(win.kw_lo))) * g.c;
      add_run(dst, row + win.kw_lo * g.c, (win.kw_hi - win.kw_lo) * g.c);
    }
  }
}

inline thread_local Scratch tls_conv_rows;
inline thread_local Scratch tls_conv_dy;

inline int conv_threads(const ConvGeom& g) {
  const double flops = 2.0 * double(g.pixels()) * double(g.k()) * double(g.cout);
  return flops >= parallel_min_flops() ? num_threads() : 1;
}

#include "conv_direct_impl.h"

// out (pixels x Cout) = im2col(x) @ w.
template <class T>
void conv_forward_t(const T* x, const T* w, T* out, const ConvGeom& g) {
#if defined(__AVX2__) && defined(__FMA__)
  if (conv_direct_ok(g, Vec<T>::W)) {
    return conv_forward_direct(x, w, out, g, g.n > 1 ? conv_threads(g) : 1);
  }
#endif
  if (!g.x_compact()) {  // the im2col rows below read x in place
    const CompactCopy<T> cx(x, g.xs, g.n, g.h, g.w, g.c);
    return conv_forward_t(cx.data, w, out, with_compact_x(g));
  }
  const std::size_t k = g.k(), p = g.cout, total = g.pixels(), chunk = conv_chunk(g, sizeof(T));
  const std::size_t chunks = ceil_div(total, chunk);
  const int nt = conv_threads(g);
  const auto body = [&] {
    // slack: whole-vector stores and edge tiles run up to one vector past the last row
    T* rows = tls_conv_rows.get<T>(chunk * k + 64);
#pragma omp for schedule(static)
    for (std::size_t ci = 0; ci < chunks; ++ci) {
      const std::size_t first = ci * chunk, count = min_size(chunk, total - first);
      im2col_rows(x, g, first, count, rows, k);
      gemm_nt(rows, std::ptrdiff_t(k), 1, w, std::ptrdiff_t(p), 1, out + first * p, p, count, k,
              p, 1, false);
      // the bias while the chunk's output is still in cache
      if (g.bias) {
        for (std::size_t i = 0; i < count; ++i) {
          add_run(out + (first + i) * p, static_cast<const T*>(g.bias), p);
        }
      }
    }
  };
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    body();
  } else {
    body();
  }
}

// dw = im2col(x)^T @ dy as dw^T (Cout x K) += dy[chunk]^T @ rows per thread: the im2col
// rows are the product's B, read in place, and only dy's chunk (Cout values per pixel) is
// packed. For up to kWgradDyTMaxCout output channels; wider layers pack the rows instead
// (conv_weight_grad_rows_t). Float32, batch 128, ResNet9's layers (AVX2 / AVX-512, one
// thread, us): conv2 16 -> 32 292 -> 244 / 210 -> 208, res1 32 -> 32 547 -> 435 / 401 ->
// 403, conv3 32 -> 64 227 -> 211 / 222 -> 213; but conv4 64 -> 128 209 -> 233 / 199 -> 250.
constexpr std::size_t kWgradDyTMaxCout = 64;

template <class T>
void conv_weight_grad_dyt(const T* x, const T* dy, T* dw, const ConvGeom& g) {
  const std::size_t k = g.k(), p = g.cout, total = g.pixels(), chunk = conv_chunk(g, sizeof(T));
  const std::size_t chunks = ceil_div(total, chunk);
  const int nt = chunks > 1 ? conv_threads(g) : 1;
  // the threads' partial dw^T, added and transposed into dw at the end
  T* partial = static_cast<T*>(needle_alloc(std::size_t(nt) * k * p * sizeof(T)));
  const auto body = [&](int t) {
    T* rows = tls_conv_rows.get<T>(chunk * k + 64);
    T* acc = partial + std::size_t(t) * k * p;
    std::memset(acc, 0, k * p * sizeof(T));
#pragma omp for schedule(static)
    for (std::size_t ci = 0; ci < chunks; ++ci) {
      const std::size_t first = ci * chunk, count = min_size(chunk, total - first);
      im2col_rows(x, g, first, count, rows, k);
      // dy[chunk]^T: element (o, pixel) at dy[(first + pixel) * p + o]
      gemm_nt(dy + first * p, 1, std::ptrdiff_t(p), rows, std::ptrdiff_t(k), 1, acc, k, p,
              count, k, 1, true);
    }
  };
  try {
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
      body(team_rank());
    } else {
      body(0);
    }
    parallel_range(k, kParallelMinElements / p + 1, [&](std::size_t s, std::size_t e) {
      for (std::size_t kk = s; kk < e; ++kk)
        for (std::size_t o = 0; o < p; ++o) {
          T sum = partial[o * k + kk];
          for (int t = 1; t < nt; ++t) sum += partial[std::size_t(t) * k * p + o * k + kk];
          dw[kk * p + o] = sum;
        }
    });
  } catch (...) {
    needle_free(partial);
    throw;
  }
  needle_free(partial);
}

// dw (K x Cout) += rows^T @ dy[chunk] per thread (each thread its own partial dw, summed).
template <class T>
void conv_weight_grad_rows_t(const T* x, const T* dy, T* dw, const ConvGeom& g) {
  const std::size_t k = g.k(), p = g.cout, total = g.pixels(), chunk = conv_chunk(g, sizeof(T));
  const std::size_t chunks = ceil_div(total, chunk);
  const int nt = chunks > 1 ? conv_threads(g) : 1;
  T* partial = nt > 1 ? static_cast<T*>(needle_alloc(std::size_t(nt) * k * p * sizeof(T)))
                      : nullptr;
  const auto body = [&](int t) {
    T* rows = tls_conv_rows.get<T>(chunk * k + 64);
    T* acc = nt > 1 ? partial + std::size_t(t) * k * p : dw;
    std::memset(acc, 0, k * p * sizeof(T));
#pragma omp for schedule(static)
    for (std::size_t ci = 0; ci < chunks; ++ci) {
      const std::size_t first = ci * chunk, count = min_size(chunk, total - first);
      im2col_rows(x, g, first, count, rows, k);
      // rows^T: element (kk, pixel) at rows[pixel * k + kk]
      gemm_nt(rows, 1, std::ptrdiff_t(k), dy + first * p, std::ptrdiff_t(p), 1, acc, p, k,
              count, p, 1, true);
    }
  };
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    body(team_rank());
    parallel_range(k * p, kParallelMinElements, [&](std::size_t s, std::size_t e) {
      for (std::size_t i = s; i < e; ++i) {
        T sum = partial[i];
        for (int t = 1; t < nt; ++t) sum += partial[std::size_t(t) * k * p + i];
        dw[i] = sum;
      }
    });
    needle_free(partial);
  } else {
    body(0);
  }
}

// dw (K x Cout) = im2col(x)^T @ dy (direct kernel, or one of the two im2col forms).
template <class T>
void conv_weight_grad_t(const T* x, const T* dy, T* dw, const ConvGeom& g) {
#if defined(__AVX2__) && defined(__FMA__)
  if (conv_direct_ok(g, Vec<T>::W)) {
    return conv_weight_grad_direct(x, dy, dw, g, g.n > 1 ? conv_threads(g) : 1);
  }
#endif
  if (!g.x_compact()) {
    const CompactCopy<T> cx(x, g.xs, g.n, g.h, g.w, g.c);
    return conv_weight_grad_t(cx.data, dy, dw, with_compact_x(g));
  }
  if (!g.dy_compact()) {
    const CompactCopy<T> cdy(dy, g.dys, g.n, g.ho, g.wo, g.cout);
    return conv_weight_grad_t(x, cdy.data, dw, with_compact_dy(g));
  }
  if (g.cout <= kWgradDyTMaxCout) return conv_weight_grad_dyt(x, dy, dw, g);
  conv_weight_grad_rows_t(x, dy, dw, g);
}

// dx = col2im(dy @ w^T), zeroed first. Threads own whole images, so their scatter-adds never
// touch the same element. w^T is made compact once (K x Cout is small) so B is read in rows.
template <class T>
void conv_input_grad_t(const T* dy, const T* w, T* dx, const ConvGeom& g) {
#if defined(__AVX2__) && defined(__FMA__)
  // Stride 1, square kernel: dx is the correlation of dy (padded by K - 1 - pad) with the
  // kernel flipped and its channel axes swapped, a forward convolution of the same FLOPs
  // that the direct kernel takes when it fits (ResNet9's res1 on AVX-512, 32 -> 32 channels
  // on 4 x 4 maps: 0.42 -> 0.34 ms at batch 128, one thread), with no col2im pass.
  if (g.stride == 1 && g.kh == g.kw && g.pad < g.kh) {
    ConvGeom f = g;
    f.h = g.ho, f.w = g.wo, f.c = g.cout, f.cout = g.c;
    f.pad = g.kh - 1 - g.pad;
    f.ho = g.h, f.wo = g.w;
    std::copy(g.dys, g.dys + 4, f.xs);
    if (conv_direct_ok(f, Vec<T>::W)) {
      T* flipped = static_cast<T*>(needle_alloc(g.k() * g.cout * sizeof(T)));
      // flipped[a][b][o][i] = w[K-1-a][K-1-b][i][o]
      for (std::size_t a = 0; a < g.kh; ++a)
        for (std::size_t b = 0; b < g.kw; ++b) {
          const T* src = w + ((g.kh - 1 - a) * g.kw + (g.kw - 1 - b)) * g.c * g.cout;
          T* dst = flipped + (a * g.kw + b) * g.cout * g.c;
          for (std::size_t i = 0; i < g.c; ++i)
            for (std::size_t o = 0; o < g.cout; ++o) dst[o * g.c + i] = src[i * g.cout + o];
        }
      try {
        conv_forward_direct(dy, flipped, dx, f, f.n > 1 ? conv_threads(f) : 1);
      } catch (...) {
        needle_free(flipped);
        throw;
      }
      needle_free(flipped);
      return;
    }
  }
#endif
  if (!g.dy_compact()) {
    const CompactCopy<T> cdy(dy, g.dys, g.n, g.ho, g.wo, g.cout);
    return conv_input_grad_t(cdy.data, w, dx, with_compact_dy(g));
  }
  const std::size_t k = g.k(), p = g.cout, chunk = conv_chunk(g, sizeof(T));
  const std::size_t per_image = g.ho * g.wo;
  T* wt = static_cast<T*>(needle_alloc(k * p * sizeof(T)));
  for (std::size_t kk = 0; kk < k; ++kk)
    for (std::size_t o = 0; o < p; ++o) wt[o * k + kk] = w[kk * p + o];
  const int nt = g.n > 1 ? conv_threads(g) : 1;
  const auto body = [&](std::size_t t, std::size_t teams) {
    T* rows = tls_conv_rows.get<T>(chunk * k + 64);
    const std::size_t n0 = g.n * t / teams, n1 = g.n * (t + 1) / teams;
    std::memset(dx + n0 * g.h * g.w * g.c, 0, (n1 - n0) * g.h * g.w * g.c * sizeof(T));
    const std::size_t end = n1 * per_image;
    for (std::size_t first = n0 * per_image; first < end; first += chunk) {
      const std::size_t count = min_size(chunk, end - first);
      gemm_nt(dy + first * p, std::ptrdiff_t(p), 1, wt, std::ptrdiff_t(k), 1, rows, k, count,
              p, k, 1, false);
      col2im_rows_add(rows, k, g, first, count, dx);
    }
  };
  try {
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
      body(std::size_t(team_rank()), std::size_t(team_size()));
    } else {
      body(0, 1);
    }
  } catch (...) {
    needle_free(wt);
    throw;
  }
  needle_free(wt);
}

void conv_forward(DType t, const void* x, const void* w, void* out, const ConvGeom& g) {
  if (t == DType::f32) {
    return conv_forward_t(static_cast<const float*>(x), static_cast<const float*>(w),
                          static_cast<float*>(out), g);
  }
  conv_forward_t(static_cast<const double*>(x), static_cast<const double*>(w),
                 static_cast<double*>(out), g);
}

void conv_weight_grad(DType t, const void* x, const void* dy, void* dw, const ConvGeom& g) {
  if (t == DType::f32) {
    return conv_weight_grad_t(static_cast<const float*>(x), static_cast<const float*>(dy),
                              static_cast<float*>(dw), g);
  }
  conv_weight_grad_t(static_cast<const double*>(x), static_cast<const double*>(dy),
                     static_cast<double*>(dw), g);
}

void conv_input_grad(DType t, const void* dy, const void* w, void* dx, const ConvGeom& g) {
  if (t == DType::f32) {
    return conv_input_grad_t(static_cast<const float*>(dy), static_cast<const float*>(w),
                             static_cast<float*>(dx), g);
  }
  conv_input_grad_t(static_cast<const double*>(dy), static_cast<const double*>(w),
                    static_cast<double*>(dx), g);
}
