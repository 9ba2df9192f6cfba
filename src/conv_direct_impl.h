// Direct convolution for inputs with few channels (the first layer of an image model: RGB,
// KW * Cin <= 24), where an im2col row is mostly short runs and building it costs as much as
// the arithmetic. Included inside `namespace needle::<isa>` by conv_impl.h (vector builds).
//
// Each image is zero-padded once into a per-thread scratch; an output pixel's window is then
// KH runs of KW * Cin contiguous values, and consecutive pixels of an output row start
// stride * Cin apart. So the kernels broadcast inputs straight from the padded image:
//   forward:      8 pixels of a row x Cout (1 or 2 vectors) accumulate over the KH runs;
//   weight grad:  one run's KW * Cin kernel rows x Cout accumulate over all pixels.
#if defined(__AVX2__) && defined(__FMA__)

constexpr std::size_t kDirectRows = 8;     // most output pixels per forward tile
constexpr std::size_t kDirectRunMax = 24;  // KW * Cin the direct kernels take

// Tile heights that keep the accumulators (rows x NV vectors) plus the operands in the 16
// (AVX2) or 32 (AVX-512) vector registers: forward rows, and weight-grad kernel rows.
template <class Z, int NV>
constexpr int kFwdRows = (Z::W * sizeof(typename Z::T) == 64 || NV == 1) ? 8 : 6;
template <class Z, int NV>
constexpr int kGradRows = (Z::W * sizeof(typename Z::T) == 64 ? 24 : 12) / NV;

inline bool conv_direct_ok(const ConvGeom& g, std::size_t width) {
  return g.kw * g.c <= 128 && g.cout <= 2 * width;
}

// The padded images: (H + 2 pad) x (W + 2 pad) x C, plus slack rows for edge tiles. A
// thread's scratch is zeroed once per call (`zero_padded`) and each image then writes only its
// interior (`fill_interior`): the border and the slack stay zero, since every image writes the
// same interior positions (copy_run's spill past a row writes zeros, and only into the next
// row's pad or interior, which comes later). Re-zeroing the border per image cost ~9% of
// conv1's forward (short runs, each a memset call).
template <class T>
void fill_interior(const T* x, const ConvGeom& g, std::size_t n, T* dst) {
  const std::size_t row = (g.w + 2 * g.pad) * g.c;
  const T* src = x + n * g.xs[0];
  const bool compact = g.x_compact();
  for (std::size_t i = 0; i < g.h; ++i) {
    T* d = dst + (g.pad + i) * row + g.pad * g.c;
    if (compact) copy_run(d, src + i * g.xs[1], g.w * g.c);
    else gather_row(src + i * g.xs[1], g.xs[2], g.xs[3], g.w, g.c, d);
  }
}

inline std::size_t padded_elems(const ConvGeom& g) {
  const std::size_t row = (g.w + 2 * g.pad) * g.c;
  // slack: a forward tile reads up to kDirectRows windows past the row's last pixel (or a
  // paired tile a whole output row past the last), a weight-grad tile up to kDirectRunMax
  // values past a run
  return (g.h + 2 * g.pad) * row + kDirectRows * g.stride * g.c + g.kw * g.c + kDirectRunMax +
         g.stride * row + 64;
}

template <class T>
void zero_padded(const ConvGeom& g, T* dst) {
  std::memset(dst, 0, padded_elems(g) * sizeof(T));
}

// The kernel rows [lo, hi) whose window rows lie in the image for output rows [oh, oh + lines):
// the others multiply only padding, and skipping them is what lets a small map beat a kernel
// that computes every tap (ResNet9's res1 on 4 x 4 maps: 10 of 12 kernel rows live). Their
// terms are exact zeros for finite weights, so the sums keep their values; a NaN or inf
// weight seen only by padding no longer turns a border output into NaN (as oneDNN, and as
// ops_conv's pruning of taps that every output sees only as padding).
struct TapRows {
  std::size_t lo, hi;
};

inline TapRows live_tap_rows(const ConvGeom& g, std::size_t oh, std::size_t lines) {
  // padded row oh * stride + a is an image row when pad <= it < pad + h
  const std::size_t top = oh * g.stride, bottom = (oh + lines - 1) * g.stride;
  const std::size_t lo = g.pad > bottom ? min_size(g.pad - bottom, g.kh) : 0;
  const std::size_t end = g.pad + g.h;
  const std::size_t hi = end > top ? min_size(end - top, g.kh) : 0;
  return {lo, hi > lo ? hi : lo};
}

// Kernel-row FMAs per image: tiles of one output row against tiles of two (which share each
// loaded kernel row, but must compute the rows either line needs).
inline bool pair_rows_pays(const ConvGeom& g) {
  std::size_t single = 0, paired = 0;
  for (std::size_t oh = 0; oh < g.ho; ++oh) {
    const TapRows t = live_tap_rows(g, oh, 1);
    single += t.hi - t.lo;
  }
  for (std::size_t oh = 0; oh < g.ho; oh += 2) {
    const std::size_t lines = min_size(2, g.ho - oh);
    const TapRows t = live_tap_rows(g, oh, lines);
    paired += lines * (t.hi - t.lo);
  }
  return paired <= single;
}

// Loads Cout values of B/dy: whole vectors when Cout fills them (masked loads cost more on
// some CPUs, AVX2's vmaskmov in particular).
template <class Z>
inline typename Z::V load_cout(const typename Z::T* p, typename Z::M lanes, bool full) {
  return full ? Z::loadu(p) : Z::load_mask(p, lanes);
}

// The kernel columns each pixel of a forward tile reads from the image rather than padding, as
// ranges [lo[r], hi[r]) of the KW * C run (pixel r of the tile; the same for both lines of a
// paired tile), and the part of the run every pixel reads, [full_lo, full_hi). Pixels past the
// tile's last (computed but not stored) count as reading all of it.
struct TapCols {
  static constexpr int kMax = 8;  // most pixels per tile row (kDirectRows)
  std::size_t lo[kMax], hi[kMax], full_lo, full_hi;
};

inline TapCols live_tap_cols(const ConvGeom& g, std::size_t w0, std::size_t mr) {
  TapCols t{};
  const std::size_t run = g.kw * g.c;
  t.full_lo = 0;
  t.full_hi = run;
  for (std::size_t r = 0; r < std::size_t(TapCols::kMax); ++r) {
    if (r >= mr) {
      t.lo[r] = 0, t.hi[r] = run;
      continue;
    }
    // padded column (w0 + r) * stride + kw is an image column when pad <= it < pad + w
    const std::size_t col = (w0 + r) * g.stride, end = g.pad + g.w;
    t.lo[r] = g.c * (g.pad > col ? min_size(g.pad - col, g.kw) : 0);
    t.hi[r] = g.c * (end > col ? min_size(end - col, g.kw) : 0);
    if (t.hi[r] < t.lo[r]) t.hi[r] = t.lo[r];
    t.full_lo = t.lo[r] > t.full_lo ? t.lo[r] : t.full_lo;
    t.full_hi = t.hi[r] < t.full_hi ? t.hi[r] : t.full_hi;
  }
  if (t.full_hi < t.full_lo) t.full_hi = t.full_lo;
  // The checked loops of the edge parts cost more per FMA than the full part: only worth it
  // when they skip at least an eighth of the tile's FMAs (res1 on 4 x 4 maps: a sixth, 284 ->
  // 252 us; conv1's first pixel, 5%, ran 6% slower with them).
  std::size_t dead = 0;
  for (std::size_t r = 0; r < mr && r < std::size_t(TapCols::kMax); ++r) {
    dead += run - (t.hi[r] - t.lo[r]);
  }
  if (8 * dead < mr * run) {
    for (std::size_t r = 0; r < std::size_t(TapCols::kMax); ++r) t.lo[r] = 0, t.hi[r] = run;
    t.full_lo = 0, t.full_hi = run;
  }
  return t;
}

// sum[r] += window values [k0, k1) of kernel row `seg` x the kernel's rows `bp` (from k0);
// with EDGE, only for the pixels whose window reads the image there (`cols`).
template <class Z, int NV, int MR, int LINES, bool EDGE, class T = typename Z::T>
inline void conv_direct_run(typename Z::V (&sum)[MR * LINES][NV], const T* seg, std::size_t lda,
                            std::size_t line_stride, const T* bp, std::size_t cout,
                            const typename Z::M (&lanes)[NV], bool full, const TapCols& cols,
                            std::size_t k0, std::size_t k1) {
  using V = typename Z::V;
  constexpr int R = MR * LINES;
#pragma GCC unroll 4
  for (std::size_t kk = k0; kk < k1; ++kk, bp += cout) {
    V b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = load_cout<Z>(bp + v * Z::W, lanes[v], full);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (EDGE && (kk < cols.lo[r % MR] || kk >= cols.hi[r % MR])) continue;
      const V x = Z::bcast(seg + (r / MR) * line_stride + (r % MR) * lda + kk);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) sum[r][v] = Z::fma(x, b[v], sum[r][v]);
    }
  }
}

// out[l][r] (output rows l < lines, pixels r < mr of each, Cout values) = sum over the kernel
// rows `taps` of window(l, r) . w; window(l, r) starts at ap + l * line_stride + r * lda.
// Kernel rows outside `taps` and, per pixel, kernel columns outside `cols` read only padding
// and are skipped. LINES = 2 puts two short output rows (Wo <= 4) in one tile, so that each
// loaded kernel row feeds 2 MR rows.
template <class Z, int NV, int MR, int LINES = 1, class T = typename Z::T>
void conv_direct_rows(const T* ap, std::size_t lda, std::size_t line_stride, const ConvGeom& g,
                      std::size_t row_stride, const T* w, T* out, std::size_t mr,
                      std::size_t lines, TapRows taps, const TapCols& cols) {
  using V = typename Z::V;
  constexpr int R = MR * LINES;
  static_assert(MR <= TapCols::kMax, "TapCols holds one range per pixel of a tile row");
  typename Z::M lanes[NV];
  for (int v = 0; v < NV; ++v) lanes[v] = Z::mask(int(g.cout) - v * Z::W);
  const bool full = g.cout == std::size_t(NV * Z::W);
  V sum[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) sum[r][v] = Z::zero();
  const std::size_t run = g.kw * g.c, cout = g.cout;
  for (std::size_t a = taps.lo; a < taps.hi; ++a) {
    const T* seg = ap + a * row_stride;
    const T* wa = w + a * run * cout;
    if (cols.full_lo > 0) {
      conv_direct_run<Z, NV, MR, LINES, true>(sum, seg, lda, line_stride, wa, cout, lanes, full,
                                               cols, 0, cols.full_lo);
    }
    conv_direct_run<Z, NV, MR, LINES, false>(sum, seg, lda, line_stride,
                                              wa + cols.full_lo * cout, cout, lanes, full, cols,
                                              cols.full_lo, cols.full_hi);
    if (cols.full_hi < run) {
      conv_direct_run<Z, NV, MR, LINES, true>(sum, seg, lda, line_stride,
                                               wa + cols.full_hi * cout, cout, lanes, full, cols,
                                               cols.full_hi, run);
    }
  }
  V bias[NV];  // added as the sums are stored: what a separate pass would add, no pass
  const T* bias_values = static_cast<const T*>(g.bias);
  for (int v = 0; v < NV; ++v) {
    bias[v] = bias_values ? Z::load_mask(bias_values + v * Z::W, lanes[v]) : Z::zero();
  }
  // constant trip counts (an early exit, not a runtime bound) keep `sum` in registers
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (std::size_t(r % MR) >= mr || std::size_t(r / MR) >= lines) continue;
    T* o = out + ((r / MR) * g.wo + (r % MR)) * g.cout;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const V value = bias_values ? Z::add(sum[r][v], bias[v]) : sum[r][v];
      Z::store_mask(o + v * Z::W, value, lanes[v]);
    }
  }
}

// The forward tile height for an output row of `wo` pixels: the kernel heights (8, 6, 4 that
// fit the registers) that compute the fewest padded rows, the taller on a tie.
inline std::size_t direct_tile(std::size_t wo, std::size_t max_rows) {
  std::size_t best = 4, best_rows = ceil_div(wo, 4) * 4;
  for (std::size_t t : {std::size_t(6), std::size_t(8)}) {
    if (t > max_rows) continue;
    const std::size_t rows = ceil_div(wo, t) * t;
    if (rows <= best_rows) best = t, best_rows = rows;
  }
  return best;
}

template <class T>
void conv_forward_direct(const T* x, const T* w, T* out, const ConvGeom& g, int nt) {
  const std::size_t row = (g.w + 2 * g.pad) * g.c, lda = g.stride * g.c;
  const bool one = g.cout <= std::size_t(Vec<T>::W);
  const std::size_t tile = direct_tile(g.wo, std::size_t(one ? kFwdRows<Vec<T>, 1>
                                                             : kFwdRows<Vec<T>, 2>));
  // Output rows of <= 4 pixels go two per tile when 8 rows of accumulators fit the registers.
  const bool paired = g.wo <= 4 && g.ho > 1 && (one || kFwdRows<Vec<T>, 2> >= 8) &&
                      pair_rows_pays(g);
  const std::size_t line = g.stride * row;
  // the columns each tile position reads: the same for every output row and image
  std::vector<TapCols> tile_cols;
  for (std::size_t w0 = 0; w0 < g.wo; w0 += tile) {
    tile_cols.push_back(live_tap_cols(g, w0, min_size(tile, g.wo - w0)));
  }
  const TapCols pair_cols = live_tap_cols(g, 0, g.wo);
  const auto body = [&] {
    T* padded = tls_conv_rows.get<T>(padded_elems(g));
    zero_padded(g, padded);
#pragma omp for schedule(static)
    for (std::size_t n = 0; n < g.n; ++n) {
      fill_interior(x, g, n, padded);
      T* image_out = out + n * g.ho * g.wo * g.cout;
      if (paired) {  // two output rows of at most 4 pixels per tile
        for (std::size_t oh = 0; oh < g.ho; oh += 2) {
          const T* ap = padded + oh * g.stride * row;
          const std::size_t lines = min_size(2, g.ho - oh);
          T* o = image_out + oh * g.wo * g.cout;
          const TapRows t = live_tap_rows(g, oh, lines);
          const TapCols& c = pair_cols;
          if (one) {
            conv_direct_rows<Vec<T>, 1, 4, 2>(ap, lda, line, g, row, w, o, g.wo, lines, t, c);
          } else {
            conv_direct_rows<Vec<T>, 2, 4, 2>(ap, lda, line, g, row, w, o, g.wo, lines, t, c);
          }
        }
        continue;
      }
      for (std::size_t oh = 0; oh < g.ho; ++oh) {
        const T* ap = padded + oh * g.stride * row;
        T* o = image_out + oh * g.wo * g.cout;
        const TapRows t = live_tap_rows(g, oh, 1);
        for (std::size_t w0 = 0; w0 < g.wo; w0 += tile) {
          const std::size_t mr = min_size(tile, g.wo - w0);
          const T* a0 = ap + w0 * lda;
          T* o0 = o + w0 * g.cout;
          const TapCols& c = tile_cols[w0 / tile];
          if (one && tile == 8) {
            conv_direct_rows<Vec<T>, 1, 8>(a0, lda, 0, g, row, w, o0, mr, 1, t, c);
          } else if (one && tile == 6) {
            conv_direct_rows<Vec<T>, 1, 6>(a0, lda, 0, g, row, w, o0, mr, 1, t, c);
          } else if (one) {
            conv_direct_rows<Vec<T>, 1, 4>(a0, lda, 0, g, row, w, o0, mr, 1, t, c);
          } else if (tile == 8) {
            conv_direct_rows<Vec<T>, 2, 8>(a0, lda, 0, g, row, w, o0, mr, 1, t, c);
          } else if (tile == 6) {
            conv_direct_rows<Vec<T>, 2, 6>(a0, lda, 0, g, row, w, o0, mr, 1, t, c);
          } else {
            conv_direct_rows<Vec<T>, 2, 4>(a0, lda, 0, g, row, w, o0, mr, 1, t, c);
          }
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

// dw rows [r0, r0 + MR) of run a (of its KW * C rows x Cout) += sum over image n's pixels of
// window values (x) dy[pixel] (`dy`: the image's gradient, HO x WO x Cout).
template <class Z, int NV, int MR, class T = typename Z::T>
void conv_direct_wgrad_rows(const T* padded, const ConvGeom& g, std::size_t row_stride,
                            std::size_t a, std::size_t r0, const T* dy, T* dw) {
  using V = typename Z::V;
  const std::size_t run = g.kw * g.c - r0;
  typename Z::M lanes[NV];
  for (int v = 0; v < NV; ++v) lanes[v] = Z::mask(int(g.cout) - v * Z::W);
  const bool full = g.cout == std::size_t(NV * Z::W);
  V sum[MR][NV];
#pragma GCC unroll 24
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) sum[r][v] = Z::zero();
  // output rows whose window row a is padding add nothing: skipped
  const std::size_t oh_lo = a >= g.pad ? 0 : ceil_div(g.pad - a, g.stride);
  const std::size_t end = g.pad + g.h;
  const std::size_t oh_hi = end > a ? min_size(g.ho, ceil_div(end - a, g.stride)) : 0;
  dy += oh_lo * g.wo * g.cout;
  for (std::size_t oh = oh_lo; oh < oh_hi; ++oh) {
    const T* base = padded + (oh * g.stride + a) * row_stride + r0;
    for (std::size_t ow = 0; ow < g.wo; ++ow, base += g.stride * g.c, dy += g.cout) {
      V b[NV];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) b[v] = load_cout<Z>(dy + v * Z::W, lanes[v], full);
#pragma GCC unroll 24
      for (int r = 0; r < MR; ++r) {  // rows past the run read the next values: discarded
        const V x = Z::bcast(base + r);
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) sum[r][v] = Z::fma(x, b[v], sum[r][v]);
      }
    }
  }
  T* d = dw + (a * g.kw * g.c + r0) * g.cout;
#pragma GCC unroll 24
  for (int r = 0; r < MR; ++r) {
    if (std::size_t(r) >= run) break;  // rows of this run left from r0
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      T* p = d + r * g.cout + v * Z::W;
      Z::store_mask(p, Z::add(sum[r][v], Z::load_mask(p, lanes[v])), lanes[v]);
    }
  }
}

// One pass of conv_direct_wgrad_rows with `rows` kernel rows (MIN when fewer), rows up to
// MAX: each height its own instantiation, so that a run of KW * C rows splits into passes
// of equal height with no discarded rows (conv1's 7 x 3 = 21: one pass of 21 on AVX-512, where a
// pass of 24 computed 3 rows for nothing; 6 + 5 + 5 + 5 on AVX2 instead of 6 x 4).
template <class Z, int NV, int MIN, int MAX, class T = typename Z::T>
void conv_direct_wgrad_pass(int rows, const T* padded, const ConvGeom& g,
                            std::size_t row_stride, std::size_t a, std::size_t r0, const T* dy,
                            T* dw) {
  if constexpr (MIN < MAX) {
    if (rows < MAX) {
      return conv_direct_wgrad_pass<Z, NV, MIN, MAX - 1>(rows, padded, g, row_stride, a, r0,
                                                         dy, dw);
    }
  }
  conv_direct_wgrad_rows<Z, NV, MAX>(padded, g, row_stride, a, r0, dy, dw);
}

// The rows of image n's share of dw: each run of KW * C kernel rows in passes of at most
// kGradRows rows, of equal height.
template <class Z, int NV, class T = typename Z::T>
void conv_direct_wgrad_image(const T* padded, const ConvGeom& g, std::size_t row_stride,
                             const T* dy, T* dw) {
  constexpr int tile = kGradRows<Z, NV>;
  const std::size_t run = g.kw * g.c, passes = ceil_div(run, std::size_t(tile));
  for (std::size_t a = 0; a < g.kh; ++a) {
    for (std::size_t i = 0; i < passes; ++i) {
      const std::size_t r0 = run * i / passes, r1 = run * (i + 1) / passes;
      // r1 - r0 >= tile / 2 unless the whole run is shorter: a pass of tile / 2 rows then,
      // the rows past the run discarded
      conv_direct_wgrad_pass<Z, NV, tile / 2, tile>(int(r1 - r0), padded, g, row_stride, a,
                                                    r0, dy, dw);
    }
  }
}

template <class T>
void conv_weight_grad_direct(const T* x, const T* dy, T* dw, const ConvGeom& g, int nt) {
  const std::size_t k = g.k(), p = g.cout, row = (g.w + 2 * g.pad) * g.c;
  T* partial = nt > 1 ? static_cast<T*>(needle_alloc(std::size_t(nt) * k * p * sizeof(T)))
                      : nullptr;
  const auto body = [&](int t) {
    T* padded = tls_conv_rows.get<T>(padded_elems(g));
    // a strided dy: each image's gradient gathered as compact (HO*WO x Cout) rows first
    T* dy_rows = g.dy_compact() ? nullptr : tls_conv_dy.get<T>(g.ho * g.wo * p);
    T* acc = nt > 1 ? partial + std::size_t(t) * k * p : dw;
    std::memset(acc, 0, k * p * sizeof(T));
    zero_padded(g, padded);
#pragma omp for schedule(static)
    for (std::size_t n = 0; n < g.n; ++n) {
      fill_interior(x, g, n, padded);
      const T* dyn = dy + n * g.dys[0];
      if (dy_rows) {
        gather_image(dyn, g.dys, g.ho, g.wo, p, dy_rows);
        dyn = dy_rows;
      }
      if (p <= std::size_t(Vec<T>::W)) {
        conv_direct_wgrad_image<Vec<T>, 1>(padded, g, row, dyn, acc);
      } else {
        conv_direct_wgrad_image<Vec<T>, 2>(padded, g, row, dyn, acc);
      }
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
#endif
