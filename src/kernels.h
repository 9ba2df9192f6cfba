// The compute kernels, built three times: for baseline x86-64 (namespace `base`), with
// AVX2+FMA+F16C (namespace `avx2`) and with AVX-512 F/BW/DQ/VL (namespace `avx512`), each
// instruction set enabled for its own translation unit only. The bindings pick one table at
// import time with __builtin_cpu_supports, so no -march=native is needed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace needle {

// tanh_grad(g, t) = g * (1 - t * t) and relu_grad(g, r) = g * sign(r): the backward of tanh and
// relu from their saved outputs in one pass (three and two kernels composed).
enum class BinOp : int { add, sub, mul, div, maximum, minimum, power, eq, ge, tanh_grad, relu_grad };
enum class UnOp : int { neg, log, exp, tanh, sqrt, abs, sign, sigmoid };
enum class RedOp : int { sum, max, min };

// Instruction kinds of ewise_program (ewise_program_impl.h) and its register count.
enum ProgramKind : int { kLoad = 0, kStore = 1, kBinary = 2, kScalar = 3, kRScalar = 4, kUnary = 5 };
constexpr int kProgramRegisters = 16;

// Geometry of a 2-D convolution over an NHWC input with a (KH, KW, Cin, Cout) kernel, the same
// stride and zero padding on both spatial dims; the output is (N, HO, WO, Cout).
// x and dy may be views: xs / dys are their element strides over (N, H, W, Cin) and
// (N, HO, WO, Cout), compact NHWC unless set otherwise (nn.Conv hands its NCHW tensors over
// as NHWC views; the kernels gather from them instead of a compact copy made first).
struct ConvGeom {
  std::size_t n, h, w, c;    // input N, H, W, Cin
  std::size_t kh, kw, cout;  // kernel
  std::size_t stride, pad;
  std::size_t ho, wo;        // output height and width
  std::size_t xs[4], dys[4];
  // forward only: Cout values added to every output pixel (nn.Conv's bias), or none
  const void* bias = nullptr;
  std::size_t k() const { return kh * kw * c; }
  std::size_t pixels() const { return n * ho * wo; }
  void set_compact_x() { xs[0] = h * w * c, xs[1] = w * c, xs[2] = c, xs[3] = 1; }
  void set_compact_dy() {
    dys[0] = ho * wo * cout, dys[1] = wo * cout, dys[2] = cout, dys[3] = 1;
  }
  void set_compact_strides() { set_compact_x(), set_compact_dy(); }
  bool x_compact() const {
    return xs[0] == h * w * c && xs[1] == w * c && xs[2] == c && xs[3] == 1;
  }
  bool dy_compact() const {
    return dys[0] == ho * wo * cout && dys[1] == wo * cout && dys[2] == cout && dys[3] == 1;
  }
};

// NumPy's MT19937 state (numpy/random/src/mt19937/mt19937.h): the key, then the position of
// the next unused word (624: all used). uniform_fill advances it as np.random.rand would.
constexpr int kMt19937Words = 624;
struct Mt19937State {
  std::uint32_t key[kMt19937Words];
  int pos;
};

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
  // out[j] = sum over i < m of a[i*n + j]: the m rows of a (m x n) added up (column sums).
  void (*sum_leading)(DType t, const void* a, void* out, std::size_t m, std::size_t n);
  // out(m x p) = a(m x n) @ b(n x p), row-major, overwrites out.
  void (*matmul)(DType t, const void* a, const void* b, void* out, std::size_t m, std::size_t n,
                 std::size_t p);
  // The same with strided operands: a(i, k) = a[i * ars + k * acs], b(k, j) = b[k * brs +
  // j * bcs] (float32/float64).
  void (*matmul_strided)(DType t, const void* a, std::ptrdiff_t ars, std::ptrdiff_t acs,
                         const void* b, std::ptrdiff_t brs, std::ptrdiff_t bcs, void* out,
                         std::size_t m, std::size_t n, std::size_t p);
  // Convolution (float32/float64, compact operands; see conv_impl.h): out (N, HO, WO, Cout) =
  // conv(x, w); dw (K x Cout) = its kernel gradient from dy; dx = its input gradient.
  void (*conv_forward)(DType t, const void* x, const void* w, void* out, const ConvGeom& g);
  void (*conv_weight_grad)(DType t, const void* x, const void* dy, void* dw, const ConvGeom& g);
  void (*conv_input_grad)(DType t, const void* dy, const void* w, void* dx, const ConvGeom& g);
  // LSTM cell gates (float32/float64, compact; see lstm_impl.h). Forward: z (B x 4H, gate
  // blocks i, f, g, o), z_add (B x 4H added before z, or null: a step's rows of an input
  // projection made for all steps at once), bias (4H, or null), c (B x H) -> h2, c2 (B x H),
  // gates (B x 4H, activations), tc = tanh(c2) (B x H). Backward: dz (B x 4H) and dc_prev
  // (B x H) from the saved gates, tc and c and the output gradients dh (plus dh_add, or
  // null) and dc (B x H).
  void (*lstm_forward)(DType t, const void* z, const void* z_add, const void* bias,
                       const void* c, void* h2, void* c2, void* gates, void* tc,
                       std::size_t batch, std::size_t hidden);
  void (*lstm_backward)(DType t, const void* gates, const void* tc, const void* c,
                        const void* dh, const void* dh_add, const void* dc, void* dz,
                        void* dc_prev, std::size_t batch, std::size_t hidden);
  // Batch normalisation, training mode (float32/float64, compact; see batchnorm_impl.h):
  // x (N, C, S) -> y, and per channel the batch mean, biased variance and 1/sqrt(var + eps);
  // backward: dx, dw, db from dy, x, w and the saved mean and invstd.
  void (*bn_forward)(DType t, const void* x, const void* w, const void* b, void* y, void* mean,
                     void* var, void* invstd, std::size_t n, std::size_t c, std::size_t s,
                     double eps);
  void (*bn_backward)(DType t, const void* dy, const void* x, const void* w, const void* mean,
                      const void* invstd, void* dx, void* dw, void* db, std::size_t n,
                      std::size_t c, std::size_t s);
  // Softmax cross-entropy over rows (float32/float64; see softmax_xent_impl.h): z (n x k) and
  // labels (n class ids, z's dtype, checked in [0, k) by the caller) -> loss and lse (n);
  // backward: dz (n x k) from z, labels, lse and the loss gradient g (n).
  void (*xent_forward)(DType t, const void* z, const void* labels, void* loss, void* lse,
                       std::size_t n, std::size_t k);
  void (*xent_backward)(DType t, const void* z, const void* labels, const void* lse,
                        const void* g, void* dz, std::size_t n, std::size_t k);
  // A chain of elementwise ops in one pass over n elements (float32/float64; see
  // ewise_program_impl.h): inputs `ins`, outputs `outs`, `ncode` five-int instructions.
  void (*ewise_program)(DType t, const void* const* ins, void* const* outs,
                        const std::int32_t* code, std::size_t ncode, const double* scalars,
                        std::size_t n);
  // n uniform [0, 1) draws from NumPy's MT19937 state `state` (advanced in place, exactly as
  // np.random.rand would; see mt19937_impl.h) into out (float32/float64): the draws, or with
  // `below` 1 where draw <= p and 0 elsewhere, compared in out's precision.
  void (*uniform_fill)(Mt19937State* state, DType t, void* out, std::size_t n, bool below,
                       double p);
  // Names of the float32 and float64 matmul micro-kernels (printed by the benchmarks).
  const char* sgemm_name;
  const char* dgemm_name;
};

namespace base { extern const KernelTable table; }
#if defined(__x86_64__) || defined(_M_X64)
namespace avx2 { extern const KernelTable table; }
#define NEEDLE_HAVE_AVX2_TABLE 1
#endif
#if defined(NEEDLE_BUILD_AVX512)  // set by CMakeLists.txt when the compiler takes -mavx512f
namespace avx512 { extern const KernelTable table; }
#define NEEDLE_HAVE_AVX512_TABLE 1
#endif

}  // namespace needle
