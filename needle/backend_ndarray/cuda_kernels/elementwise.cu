// Elementwise kernels on compact arrays: binary, scalar, unary and dtype casts.
//
// One template per shape of operation, one functor per op, and extern "C" instantiations named
// <op>_<f32|f64|f16> so that the Python side finds them by plain name. Each kernel computes in
// Traits<T>::acc (float for float16) and guards its bounds with a grid-stride loop.
#include "common.cuh"

template <typename T, typename Op>
__device__ __forceinline__ void binary_body(const T* __restrict__ a, const T* __restrict__ b,
                                            T* __restrict__ out, long long n) {
  NEEDLE_FOR_EACH(i, n) {
    out[i] = Traits<T>::store(Op::apply(Traits<T>::load(a[i]), Traits<T>::load(b[i])));
  }
}

template <typename T, typename Op>
__device__ __forceinline__ void scalar_body(const T* __restrict__ a, T val, T* __restrict__ out,
                                            long long n) {
  const typename Traits<T>::acc v = Traits<T>::load(val);
  NEEDLE_FOR_EACH(i, n) { out[i] = Traits<T>::store(Op::apply(Traits<T>::load(a[i]), v)); }
}

template <typename T, typename Op>
__device__ __forceinline__ void unary_body(const T* __restrict__ a, T* __restrict__ out,
                                           long long n) {
  NEEDLE_FOR_EACH(i, n) { out[i] = Traits<T>::store(Op::apply(Traits<T>::load(a[i]))); }
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
  static __device__ A apply(A g, A r) {
    return g * (r > A(0) ? A(1) : (r < A(0) ? A(-1) : r));
  }
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
  MACRO(NAME, OP, f16, half_t)

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
  NEEDLE_FOR_EACH(i, n) { out[i] = Convert<Out, In>::apply(a[i]); }
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
  NEEDLE_CAST(SIN, TIN, f16, half_t)

NEEDLE_CAST_FROM(f32, float)
NEEDLE_CAST_FROM(f64, double)
NEEDLE_CAST_FROM(f16, half_t)

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

template <typename T>
__device__ __forceinline__ void program_body(const ProgramArgs& p, long long n) {
  typedef typename Traits<T>::acc A;
  NEEDLE_FOR_EACH(i, n) {
    T regs[NEEDLE_PROGRAM_REGISTERS];
    for (int k = 0; k < p.n_code; ++k) {
      const int* c = p.code + 5 * k;
      const int kind = c[0], op = c[1], dst = c[2], a = c[3], b = c[4];
      if (kind == 0) {
        regs[dst] = reinterpret_cast<const T*>(p.ins[a])[i];
      } else if (kind == 1) {
        reinterpret_cast<T*>(p.outs[dst])[i] = regs[a];
      } else if (kind == 2) {
        regs[dst] = Traits<T>::store(
            program_binary<A>(op, Traits<T>::load(regs[a]), Traits<T>::load(regs[b])));
      } else if (kind == 3 || kind == 4) {
        const A x = Traits<T>::load(regs[a]);
        const A v = Traits<T>::load(Traits<T>::store((A)p.scalars[b]));
        const bool reversed = kind == 4 && program_reverses(op);
        regs[dst] = Traits<T>::store(reversed ? program_binary<A>(op, v, x)
                                              : program_binary<A>(op, x, v));
      } else {
        regs[dst] = Traits<T>::store(program_unary<A>(op, Traits<T>::load(regs[a])));
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    ewise_program_f32(const ProgramArgs p, long long n) {
  program_body<float>(p, n);
}
extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    ewise_program_f64(const ProgramArgs p, long long n) {
  program_body<double>(p, n);
}
