// Elementwise kernels on compact arrays: binary, scalar, unary, dtype casts and programs.
//
// One template per shape of operation, one functor per op, and extern "C" instantiations named
// <op>_<f32|f64|f16|bf16> so that the Python side finds them by plain name. Each kernel computes in
// Traits<T>::acc (float for float16) and guards its bounds with a grid-stride loop.
#include "common.cuh"

// The kernels move NEEDLE_PACK = 4 elements per thread with one vector access (16 bytes for
// float) when every pointer of the launch is aligned to such a pack: a 1e8-element float32
// scalar multiply ran at 0.49x of a device-to-device copy one element per thread and at 0.98x
// with float4 loads (H200, bench/gpu_profile.py). The launcher sizes the grid for n / 4
// threads (grid kind "packed"); a grid-stride loop over single elements covers the tail and
// unaligned buffers. Each lane computes exactly what the one-element path computes, so both
// give the same bits.
#define NEEDLE_PACK 4

template <typename T, int W>
struct alignas(W * sizeof(T)) Pack {
  T v[W];
};

__device__ __forceinline__ bool packs_aligned(unsigned long long address_bits, int pack_bytes) {
  return (address_bits & (unsigned long long)(pack_bytes - 1)) == 0;
}

__device__ __forceinline__ unsigned long long address(const void* p) {
  return reinterpret_cast<unsigned long long>(p);
}

// out = f(a) (f maps one element) over `packs` packs of W elements from element `first`.
template <int W, typename In, typename Out, typename F>
__device__ __forceinline__ void map_packs(const In* a, Out* out, long long packs,
                                          long long first, F f) {
  const Pack<In, W>* pa = reinterpret_cast<const Pack<In, W>*>(a + first);
  Pack<Out, W>* po = reinterpret_cast<Pack<Out, W>*>(out + first);
  NEEDLE_FOR_EACH(i, packs) {
    const Pack<In, W> x = pa[i];
    Pack<Out, W> r;
#pragma unroll
    for (int w = 0; w < W; ++w) r.v[w] = f(x.v[w]);
    po[i] = r;
  }
}

// out = f(a, b) over `packs` packs of W elements from element `first`.
template <int W, typename T, typename F>
__device__ __forceinline__ void map2_packs(const T* a, const T* b, T* out, long long packs,
                                           long long first, F f) {
  const Pack<T, W>* pa = reinterpret_cast<const Pack<T, W>*>(a + first);
  const Pack<T, W>* pb = reinterpret_cast<const Pack<T, W>*>(b + first);
  Pack<T, W>* po = reinterpret_cast<Pack<T, W>*>(out + first);
  NEEDLE_FOR_EACH(i, packs) {
    const Pack<T, W> x = pa[i], y = pb[i];
    Pack<T, W> r;
#pragma unroll
    for (int w = 0; w < W; ++w) r.v[w] = f(x.v[w], y.v[w]);
    po[i] = r;
  }
}

// out[i] = f(a[i]) for i < n: packs where both pointers allow, single elements for the rest.
template <typename In, typename Out, typename F>
__device__ __forceinline__ void map(const In* a, Out* out, long long n, F f) {
  long long done = 0;
  if (packs_aligned(address(a), sizeof(Pack<In, NEEDLE_PACK>)) &&
      packs_aligned(address(out), sizeof(Pack<Out, NEEDLE_PACK>))) {
    done = n / NEEDLE_PACK * NEEDLE_PACK;
    map_packs<NEEDLE_PACK>(a, out, n / NEEDLE_PACK, 0, f);
  }
  map_packs<1>(a, out, n - done, done, f);
}

template <typename T, typename F>
__device__ __forceinline__ void map2(const T* a, const T* b, T* out, long long n, F f) {
  long long done = 0;
  if (packs_aligned(address(a) | address(b) | address(out), sizeof(Pack<T, NEEDLE_PACK>))) {
    done = n / NEEDLE_PACK * NEEDLE_PACK;
    map2_packs<NEEDLE_PACK>(a, b, out, n / NEEDLE_PACK, 0, f);
  }
  map2_packs<1>(a, b, out, n - done, done, f);
}

template <typename T, typename Op>
__device__ __forceinline__ void binary_body(const T* __restrict__ a, const T* __restrict__ b,
                                            T* __restrict__ out, long long n) {
  map2(a, b, out, n, [](T x, T y) {
    return Traits<T>::store(Op::apply(Traits<T>::load(x), Traits<T>::load(y)));
  });
}

template <typename T, typename Op>
__device__ __forceinline__ void scalar_body(const T* __restrict__ a, T val, T* __restrict__ out,
                                            long long n) {
  const typename Traits<T>::acc v = Traits<T>::load(val);
  map(a, out, n, [v](T x) { return Traits<T>::store(Op::apply(Traits<T>::load(x), v)); });
}

template <typename T, typename Op>
__device__ __forceinline__ void unary_body(const T* __restrict__ a, T* __restrict__ out,
                                           long long n) {
  map(a, out, n, [](T x) { return Traits<T>::store(Op::apply(Traits<T>::load(x))); });
}

// ---- binary functors (also used with the scalar as second operand) ----
struct OpAdd { template <typename A> static __device__ A apply(A a, A b) { return a + b; } };
struct OpSub { template <typename A> static __device__ A apply(A a, A b) { return a - b; } };
struct OpRsub { template <typename A> static __device__ A apply(A a, A b) { return b - a; } };
struct OpMul { template <typename A> static __device__ A apply(A a, A b) { return a * b; } };
struct OpDiv { template <typename A> static __device__ A apply(A a, A b) { return a / b; } };
struct OpRdiv { template <typename A> static __device__ A apply(A a, A b) { return b / a; } };
struct OpPow { template <typename A> static __device__ A apply(A a, A b) { return m_pow(a, b); } };
struct OpRpow { template <typename A> static __device__ A apply(A a, A b) { return m_pow(b, a); } };
struct OpMax { template <typename A> static __device__ A apply(A a, A b) { return nan_max(a, b); } };
struct OpMin { template <typename A> static __device__ A apply(A a, A b) { return nan_min(a, b); } };
struct OpEq { template <typename A> static __device__ A apply(A a, A b) { return a == b ? A(1) : A(0); } };
struct OpGe { template <typename A> static __device__ A apply(A a, A b) { return a >= b ? A(1) : A(0); } };
struct OpLe { template <typename A> static __device__ A apply(A a, A b) { return a <= b ? A(1) : A(0); } };
// The backward steps of tanh and relu from their saved outputs (g, t) and (g, r), rounded as
// the composed kernels round (t * t, then 1 - that, then g * that; g * sign(r), with
// sign(+-0) = r itself and sign(NaN) = NaN), so that fused and composed agree bit for bit.
struct OpTanhGrad {
  template <typename A>
  static __device__ A apply(A g, A t) {
    const A square = t * t;
    const A slope = A(1) - square;
    return g * slope;
  }
};
struct OpReluGrad {
  template <typename A>
  static __device__ A apply(A g, A r) { return relu_grad_step(g, r); }
};

// ---- unary functors ----
struct OpNeg { template <typename A> static __device__ A apply(A a) { return -a; } };
struct OpLog { template <typename A> static __device__ A apply(A a) { return m_log(a); } };
struct OpExp { template <typename A> static __device__ A apply(A a) { return m_exp(a); } };
struct OpTanh { template <typename A> static __device__ A apply(A a) { return m_tanh(a); } };
struct OpSqrt { template <typename A> static __device__ A apply(A a) { return m_sqrt(a); } };
struct OpAbs { template <typename A> static __device__ A apply(A a) { return m_abs(a); } };
struct OpSign {
  template <typename A>
  static __device__ A apply(A a) {
    if (a != a) return a;  // NaN stays NaN, as np.sign
    return a > A(0) ? A(1) : (a < A(0) ? A(-1) : A(0));
  }
};
struct OpSigmoid {
  // Split by sign so that exp never overflows: e = exp(-|x|) is in (0, 1].
  template <typename A>
  static __device__ A apply(A a) {
    A e = m_exp(-m_abs(a));
    return a >= A(0) ? A(1) / (A(1) + e) : e / (A(1) + e);
  }
};

#define NEEDLE_BINARY_T(NAME, OP, SUF, T)                                                    \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      NAME##_##SUF(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,    \
                   long long n) {                                                            \
    binary_body<T, OP>(a, b, out, n);                                                        \
  }
#define NEEDLE_SCALAR_T(NAME, OP, SUF, T)                                                    \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      NAME##_##SUF(const T* __restrict__ a, T val, T* __restrict__ out, long long n) {       \
    scalar_body<T, OP>(a, val, out, n);                                                      \
  }
#define NEEDLE_UNARY_T(NAME, OP, SUF, T)                                                     \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      NAME##_##SUF(const T* __restrict__ a, T* __restrict__ out, long long n) {              \
    unary_body<T, OP>(a, out, n);                                                            \
  }
#define NEEDLE_ALL_TYPES(MACRO, NAME, OP) \
  MACRO(NAME, OP, f32, float)             \
  MACRO(NAME, OP, f64, double)            \
  MACRO(NAME, OP, f16, half_t)            \
  MACRO(NAME, OP, bf16, bf16_t)

NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_add, OpAdd)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_sub, OpSub)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_mul, OpMul)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_div, OpDiv)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_maximum, OpMax)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_minimum, OpMin)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_power, OpPow)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_eq, OpEq)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_ge, OpGe)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_tanh_grad, OpTanhGrad)
NEEDLE_ALL_TYPES(NEEDLE_BINARY_T, ewise_relu_grad, OpReluGrad)

// out[i] = a[i] + row[i % cols] for i < n: a row added to every row of an (n / cols, cols)
// array (a linear layer's bias) without a broadcast copy; each sum is ewise_add's. out may
// be a (both are read and written at one index only).
#define NEEDLE_ADD_ROWS_T(NAME, OP, SUF, T)                                                   \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      NAME##_##SUF(const T* a, const T* __restrict__ row, T* out, long long n,               \
                   long long cols) {                                                         \
    NEEDLE_FOR_EACH(i, n) {                                                                  \
      const T r = row[i % cols];                                                             \
      out[i] = Traits<T>::store(OP::apply(Traits<T>::load(a[i]), Traits<T>::load(r)));       \
    }                                                                                        \
  }
NEEDLE_ALL_TYPES(NEEDLE_ADD_ROWS_T, ewise_add_rows, OpAdd)

NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_add, OpAdd)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_sub, OpSub)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_rsub, OpRsub)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_mul, OpMul)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_div, OpDiv)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_rdiv, OpRdiv)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_power, OpPow)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_rpower, OpRpow)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_maximum, OpMax)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_minimum, OpMin)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_eq, OpEq)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_ge, OpGe)
NEEDLE_ALL_TYPES(NEEDLE_SCALAR_T, scalar_le, OpLe)

NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_neg, OpNeg)
NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_log, OpLog)
NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_exp, OpExp)
NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_tanh, OpTanh)
NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_sqrt, OpSqrt)
NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_abs, OpAbs)
NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_sign, OpSign)
NEEDLE_ALL_TYPES(NEEDLE_UNARY_T, ewise_sigmoid, OpSigmoid)

// ---- casts: ewise_cast_<from>_<to> for every ordered pair (identity included) ----
template <typename In, typename Out>
__device__ __forceinline__ void cast_body(const In* __restrict__ a, Out* __restrict__ out,
                                          long long n) {
  map(a, out, n, [](In x) { return Convert<Out, In>::apply(x); });
}

#define NEEDLE_CAST(SIN, TIN, SOUT, TOUT)                                                    \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      ewise_cast_##SIN##_##SOUT(const TIN* __restrict__ a, TOUT* __restrict__ out,           \
                                long long n) {                                               \
    cast_body<TIN, TOUT>(a, out, n);                                                         \
  }
#define NEEDLE_CAST_FROM(SIN, TIN)    \
  NEEDLE_CAST(SIN, TIN, f32, float)   \
  NEEDLE_CAST(SIN, TIN, f64, double)  \
  NEEDLE_CAST(SIN, TIN, f16, half_t)  \
  NEEDLE_CAST(SIN, TIN, bf16, bf16_t)

NEEDLE_CAST_FROM(f32, float)
NEEDLE_CAST_FROM(f64, double)
NEEDLE_CAST_FROM(f16, half_t)
NEEDLE_CAST_FROM(bf16, bf16_t)

// ---- ewise_program: a chain of the ops above over n elements in one pass ------------------
// Instruction kinds and op numbers as needle/backend_ndarray/ewise_codes.py (LOAD, STORE,
// BINARY, SCALAR, RSCALAR, UNARY; BINARY_OPS, UNARY_OPS), validated on the host. Each op
// applies its own kernel's functor in Traits<T>::acc and rounds to T, and scalars are rounded
// to T first (as the scalar kernels receive them), so a program gives the bits of the separate
// launches. The arguments travel by value; the host image is _PROGRAM_RECORD in
// ndarray_backend_cuda.py (no padding: every field is naturally aligned).
#define NEEDLE_PROGRAM_IO 16
#define NEEDLE_PROGRAM_SCALARS 32
#define NEEDLE_PROGRAM_CODE 96
#define NEEDLE_PROGRAM_REGISTERS 16

struct ProgramArgs {
  unsigned long long ins[NEEDLE_PROGRAM_IO];
  unsigned long long outs[NEEDLE_PROGRAM_IO];
  double scalars[NEEDLE_PROGRAM_SCALARS];
  int code[5 * NEEDLE_PROGRAM_CODE];
  int n_code;
  int pad;
};

template <typename A>
__device__ __forceinline__ A program_binary(int op, A a, A b) {
  switch (op) {
    case 0: return OpAdd::apply(a, b);
    case 1: return OpSub::apply(a, b);
    case 2: return OpMul::apply(a, b);
    case 3: return OpDiv::apply(a, b);
    case 4: return OpMax::apply(a, b);
    case 5: return OpMin::apply(a, b);
    case 6: return OpPow::apply(a, b);
    case 7: return OpEq::apply(a, b);
    case 8: return OpGe::apply(a, b);
    case 9: return OpTanhGrad::apply(a, b);
    default: return OpReluGrad::apply(a, b);
  }
}

template <typename A>
__device__ __forceinline__ A program_unary(int op, A a) {
  switch (op) {
    case 0: return OpNeg::apply(a);
    case 1: return OpLog::apply(a);
    case 2: return OpExp::apply(a);
    case 3: return OpTanh::apply(a);
    case 4: return OpSqrt::apply(a);
    case 5: return OpAbs::apply(a);
    case 6: return OpSign::apply(a);
    default: return OpSigmoid::apply(a);
  }
}

// The reversed scalar ops that have a kernel of their own (scalar_rsub, scalar_rdiv,
// scalar_rpower, scalar_le for ge) take (scalar, x); the commutative ones keep (x, scalar),
// as scalar_add / scalar_maximum / ... compute them; tanh_grad and relu_grad go through the
// binary kernel with the scalar first.
__device__ __forceinline__ bool program_reverses(int op) {
  return op == 1 || op == 3 || op == 6 || op == 8 || op == 9 || op == 10;
}

// One pass of the program over W consecutive elements starting at pack ``i`` (element W * i).
template <typename T, int W>
__device__ __forceinline__ void program_pack(const ProgramArgs& p, long long i) {
  typedef typename Traits<T>::acc A;
  Pack<T, W> regs[NEEDLE_PROGRAM_REGISTERS];
  for (int k = 0; k < p.n_code; ++k) {
    const int* c = p.code + 5 * k;
    const int kind = c[0], op = c[1], dst = c[2], a = c[3], b = c[4];
    if (kind == 0) {
      regs[dst] = reinterpret_cast<const Pack<T, W>*>(p.ins[a])[i];
    } else if (kind == 1) {
      reinterpret_cast<Pack<T, W>*>(p.outs[dst])[i] = regs[a];
    } else if (kind == 2) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        regs[dst].v[w] = Traits<T>::store(program_binary<A>(
            op, Traits<T>::load(regs[a].v[w]), Traits<T>::load(regs[b].v[w])));
      }
    } else if (kind == 3 || kind == 4) {
      const A v = Traits<T>::load(Traits<T>::store((A)p.scalars[b]));
      const bool reversed = kind == 4 && program_reverses(op);
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const A x = Traits<T>::load(regs[a].v[w]);
        regs[dst].v[w] = Traits<T>::store(reversed ? program_binary<A>(op, v, x)
                                                   : program_binary<A>(op, x, v));
      }
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        regs[dst].v[w] = Traits<T>::store(program_unary<A>(op, Traits<T>::load(regs[a].v[w])));
      }
    }
  }
}

// Packs of NEEDLE_PACK elements when every buffer is aligned to one (unused slots are 0),
// then single elements for the tail, as the kernels above.
template <typename T>
__device__ __forceinline__ void program_body(const ProgramArgs& p, long long n) {
  unsigned long long bits = 0;
  for (int k = 0; k < NEEDLE_PROGRAM_IO; ++k) bits |= p.ins[k] | p.outs[k];
  long long done = 0;
  if (packs_aligned(bits, sizeof(Pack<T, NEEDLE_PACK>))) {
    done = n / NEEDLE_PACK * NEEDLE_PACK;
    NEEDLE_FOR_EACH(i, n / NEEDLE_PACK) program_pack<T, NEEDLE_PACK>(p, i);
  }
  NEEDLE_FOR_EACH(i, n - done) program_pack<T, 1>(p, done + i);
}

extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    ewise_program_f32(const ProgramArgs p, long long n) {
  program_body<float>(p, n);
}
extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    ewise_program_f64(const ProgramArgs p, long long n) {
  program_body<double>(p, n);
}
