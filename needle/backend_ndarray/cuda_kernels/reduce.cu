// Row reductions: `a` holds `rows` contiguous rows of `reduce_size` elements; reduce each.
//
// Three kernels per op and dtype; the launcher (needle/backend_ndarray/_cuda/launch.py,
// plan_reduce) picks them:
//   reduce_small_*   one thread per row, for short rows (<= 32 elements);
//   reduce_block_*   one block per (row, chunk): 256 threads read the chunk coalesced, each
//                    keeps a partial, then warp shuffles and shared memory combine the 256
//                    partials. With chunks == 1 it writes the row's result directly;
//   reduce_partial_* the same with chunks > 1, writing partials in the compute type
//                    (float for float16) to a workspace, which reduce_final_* (In = compute
//                    type, Out = element type) reduces with chunks as the row length.
// Few long rows (a full sum) thus still spread over every SM.
#include "common.cuh"

template <typename In, typename Out, typename Op>
__device__ __forceinline__ void block_body(const In* __restrict__ a, Out* __restrict__ out,
                                           long long rows, long long reduce_size,
                                           long long chunks) {
  typedef typename Traits<In>::acc A;
  const long long chunk_len = (reduce_size + chunks - 1) / chunks;
  // Grid-stride over (row, chunk) pairs; the condition is uniform across the block, so every
  // thread reaches the barriers in block_reduce.
  for (long long blk = blockIdx.x; blk < rows * chunks; blk += gridDim.x) {
    const long long row = blk / chunks, chunk = blk - row * chunks;
    const long long begin = chunk * chunk_len;
    const long long end = min(begin + chunk_len, reduce_size);
    const In* src = a + row * reduce_size;
    A acc = Op::template identity<A>();
    for (long long k = begin + threadIdx.x; k < end; k += blockDim.x) {
      acc = Op::template combine<A>(acc, Traits<In>::load(src[k]));
    }
    acc = block_reduce<A, Op>(acc);
    if (threadIdx.x == 0) out[blk] = Convert<Out, A>::apply(acc);
  }
}

template <typename In, typename Out, typename Op>
__device__ __forceinline__ void small_body(const In* __restrict__ a, Out* __restrict__ out,
                                           long long rows, long long reduce_size) {
  typedef typename Traits<In>::acc A;
  NEEDLE_FOR_EACH(row, rows) {
    const In* src = a + row * reduce_size;
    A acc = Op::template identity<A>();
    for (long long k = 0; k < reduce_size; ++k) {
      acc = Op::template combine<A>(acc, Traits<In>::load(src[k]));
    }
    out[row] = Convert<Out, A>::apply(acc);
  }
}

#define NEEDLE_REDUCE_T(NAME, OP, SUF, T)                                                    \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_small_##NAME##_##SUF(const T* __restrict__ a, T* __restrict__ out,              \
                                  long long rows, long long reduce_size) {                   \
    small_body<T, T, OP>(a, out, rows, reduce_size);                                         \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_block_##NAME##_##SUF(const T* __restrict__ a, T* __restrict__ out,              \
                                  long long rows, long long reduce_size, long long chunks) { \
    block_body<T, T, OP>(a, out, rows, reduce_size, chunks);                                 \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_partial_##NAME##_##SUF(const T* __restrict__ a,                                 \
                                    Traits<T>::acc* __restrict__ out, long long rows,        \
                                    long long reduce_size, long long chunks) {               \
    block_body<T, Traits<T>::acc, OP>(a, out, rows, reduce_size, chunks);                    \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_final_##NAME##_##SUF(const Traits<T>::acc* __restrict__ a,                      \
                                  T* __restrict__ out, long long rows, long long chunks) {   \
    block_body<Traits<T>::acc, T, OP>(a, out, rows, chunks, 1);                              \
  }

#define NEEDLE_REDUCE_ALL(NAME, OP)        \
  NEEDLE_REDUCE_T(NAME, OP, f32, float)    \
  NEEDLE_REDUCE_T(NAME, OP, f64, double)   \
  NEEDLE_REDUCE_T(NAME, OP, f16, half_t)

NEEDLE_REDUCE_ALL(sum, RedSum)
NEEDLE_REDUCE_ALL(max, RedMax)
NEEDLE_REDUCE_ALL(min, RedMin)

// Column sums: out[j] = the sum over i < rows of a[i * cols + j], the rows of a (rows, cols)
// array added up (a linear layer's bias gradient). One thread per column adds its rows in
// order in the compute type (float for float16), as the C++ kernel does; neighbouring
// threads read neighbouring elements of each row.
#define NEEDLE_SUM_LEADING_T(SUF, T)                                                         \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_sum_leading_##SUF(const T* __restrict__ a, T* __restrict__ out, long long rows, \
                               long long cols) {                                             \
    typedef Traits<T>::acc A;                                                                \
    NEEDLE_FOR_EACH(j, cols) {                                                               \
      A acc = A(0);                                                                          \
      for (long long i = 0; i < rows; ++i) acc += Traits<T>::load(a[i * cols + j]);          \
      out[j] = Traits<T>::store(acc);                                                        \
    }                                                                                        \
  }
NEEDLE_SUM_LEADING_T(f32, float)
NEEDLE_SUM_LEADING_T(f64, double)
NEEDLE_SUM_LEADING_T(f16, half_t)
