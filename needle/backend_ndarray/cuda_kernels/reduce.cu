// Reductions of contiguous data, over the last axis (rows) and over leading axes (columns).
//
// Rows: `a` holds `rows` contiguous rows of `reduce_size` elements; reduce each. The launcher
// (needle/backend_ndarray/_cuda/launch.py, plan_reduce) picks the kernels:
//   reduce_small_*   one thread per row, for short rows (<= 32 elements);
//   reduce_warp_*    one warp per row (8 rows per block), for rows of up to 1024 elements;
//   reduce_block_*   one block per (row, chunk), the 256 partials combined by warp shuffles
//                    and shared memory. With chunks == 1 it writes the row's result directly;
//   reduce_partial_* the same with chunks > 1, writing partials in the compute type (float
//                    for float16) to a workspace, which reduce_final_* (In = compute type,
//                    Out = element type) reduces with chunks as the row length.
// Few long rows (a full sum) thus still spread over every SM, in two launches.
//
// Bandwidth: a reduction reads every element once, so it runs at the speed of its loads. Each
// thread reads 16-byte vectors (float4 for float) and issues NEEDLE_UNROLL of them before it
// combines any, so that enough loads are in flight per SM to cover the memory latency; one
// accumulator per vector lane. A span's elements before its first 16-byte boundary and after
// its last whole vector are read one per thread. Every order of combination is fixed by the
// launch shape alone: the same inputs give the same bits run to run (no atomics).
#include "common.cuh"

#define NEEDLE_UNROLL 4

template <typename T, int W>
struct alignas(W * sizeof(T)) Vec {
  T v[W];
};

// acc[w] = op(acc[w], x.v[w]) for every lane, in the compute type.
template <typename Op, typename A, typename In, int W>
__device__ __forceinline__ void combine_vec(A (&acc)[W], const Vec<In, W>& x) {
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = Op::template combine<A>(acc[w], Traits<In>::load(x.v[w]));
}

// Elements of T per 16-byte vector.
template <typename T>
struct VecWidth {
  static constexpr int value = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
};

// src[0, n) reduced by `lanes` threads (this one is `lane`, lanes >= the vector width): this
// thread's partial, in the compute type.
template <typename In, typename Op>
__device__ __forceinline__ typename Traits<In>::acc span_reduce(const In* __restrict__ src,
                                                                long long n, int lane,
                                                                int lanes) {
  typedef typename Traits<In>::acc A;
  constexpr int W = VecWidth<In>::value;
  A acc[W];
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = Op::template identity<A>();
  const unsigned long long misalign = reinterpret_cast<unsigned long long>(src) & 15ull;
  long long head = misalign ? (long long)((16 - misalign) / sizeof(In)) : 0;
  if (head > n) head = n;
  const long long vecs = (n - head) / W;
  const Vec<In, W>* v = reinterpret_cast<const Vec<In, W>*>(src + head);
  long long i = lane;
  for (; i + (NEEDLE_UNROLL - 1) * (long long)lanes < vecs; i += NEEDLE_UNROLL * lanes) {
    Vec<In, W> x[NEEDLE_UNROLL];
#pragma unroll
    for (int u = 0; u < NEEDLE_UNROLL; ++u) x[u] = v[i + u * (long long)lanes];
#pragma unroll
    for (int u = 0; u < NEEDLE_UNROLL; ++u) combine_vec<Op>(acc, x[u]);
  }
  for (; i < vecs; i += lanes) combine_vec<Op>(acc, v[i]);
  const long long tail = head + vecs * W;  // fewer than W elements each side
  if (lane < head) acc[0] = Op::template combine<A>(acc[0], Traits<In>::load(src[lane]));
  if (lane < n - tail) {
    acc[W - 1] = Op::template combine<A>(acc[W - 1], Traits<In>::load(src[tail + lane]));
  }
  A r = acc[0];
#pragma unroll
  for (int w = 1; w < W; ++w) r = Op::template combine<A>(r, acc[w]);
  return r;
}

template <typename A, typename Op>
__device__ __forceinline__ A warp_reduce(A v) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    v = Op::template combine<A>(v, __shfl_down_sync(0xffffffffu, v, delta));
  }
  return v;
}

template <typename In, typename Out, typename Op>
__device__ __forceinline__ void block_body(const In* __restrict__ a, Out* __restrict__ out,
                                           long long rows, long long reduce_size,
                                           long long chunks) {
  typedef typename Traits<In>::acc A;
  constexpr int W = VecWidth<In>::value;
  // Chunks start on whole vectors of an aligned row.
  const long long chunk_len = ((reduce_size + chunks - 1) / chunks + W - 1) / W * W;
  // Grid-stride over (row, chunk) pairs; the condition is uniform across the block, so every
  // thread reaches the barriers in block_reduce.
  for (long long blk = blockIdx.x; blk < rows * chunks; blk += gridDim.x) {
    const long long row = blk / chunks, chunk = blk - row * chunks;
    const long long begin = min(chunk * chunk_len, reduce_size);
    const long long end = min(begin + chunk_len, reduce_size);
    A acc = span_reduce<In, Op>(a + row * reduce_size + begin, end - begin, threadIdx.x,
                                blockDim.x);
    acc = block_reduce<A, Op>(acc);
    if (threadIdx.x == 0) out[blk] = Convert<Out, A>::apply(acc);
  }
}

template <typename T, typename Op>
__device__ __forceinline__ void warp_body(const T* __restrict__ a, T* __restrict__ out,
                                          long long rows, long long reduce_size) {
  typedef typename Traits<T>::acc A;
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  // The row is uniform across a warp, so all 32 lanes reach the shuffles.
  for (long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
       row < rows; row += warps) {
    A acc = span_reduce<T, Op>(a + row * reduce_size, reduce_size, lane, 32);
    acc = warp_reduce<A, Op>(acc);
    if (lane == 0) out[row] = Convert<T, A>::apply(acc);
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
      reduce_warp_##NAME##_##SUF(const T* __restrict__ a, T* __restrict__ out,               \
                                 long long rows, long long reduce_size) {                    \
    warp_body<T, OP>(a, out, rows, reduce_size);                                             \
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

// ---- leading axes --------------------------------------------------------------------------
// Column reductions (sum, max, min): out[j] = the reduction over rows i of a[i * n + j], `a`
// an (m, n) row-major array (a linear layer's bias gradient, a sum over axis 0). The launcher
// (plan_reduce_leading) picks, per call:
//   width   elements per load (1, 2, 4 or 8; a 16-byte vector at most), when n and the
//           buffer address allow: each thread owns `width` neighbouring columns;
//   lanes   threads per row (a power of two <= 256); the block's 256 / lanes "row lanes"
//           walk rows lane, lane + R, ... (R = 256 / lanes), so a warp reads neighbouring
//           columns of neighbouring rows, coalesced, even when there are few columns;
//   chunks  row ranges handled by different blocks: their partials (compute type) go to a
//           (chunks, n) workspace that the _final kernel reduces, chunks in order.
// Each thread loads NEEDLE_UNROLL rows before it adds them, in row order. With R == 1 and one
// chunk every column is added up row by row in order (what the NumPy and C++ backends do,
// bitwise); otherwise each row lane adds its rows in order and the R lanes, then the chunks,
// are combined in a fixed order.
template <int W, typename In, typename Out, typename Op>
__device__ __forceinline__ void leading_body(const In* __restrict__ a, Out* __restrict__ out,
                                             long long m, long long n, int lanes,
                                             long long chunks) {
  typedef typename Traits<In>::acc A;
  __shared__ A part[NEEDLE_THREADS * W];
  const int rl = threadIdx.x / lanes, cl = threadIdx.x - rl * lanes;
  const int R = blockDim.x / lanes;
  const long long groups = n / W, col_blocks = (groups + lanes - 1) / lanes;
  const long long chunk_rows = (m + chunks - 1) / chunks;
  const Vec<In, W>* v = reinterpret_cast<const Vec<In, W>*>(a);
  // Grid-stride over (chunk, column block); uniform across the block (barriers below).
  for (long long blk = blockIdx.x; blk < chunks * col_blocks; blk += gridDim.x) {
    const long long chunk = blk / col_blocks;
    const long long g = (blk - chunk * col_blocks) * lanes + cl;
    const long long r0 = chunk * chunk_rows, r1 = min(r0 + chunk_rows, m);
    A acc[W];
#pragma unroll
    for (int w = 0; w < W; ++w) acc[w] = Op::template identity<A>();
    if (g < groups) {
      long long i = r0 + rl;
      for (; i + (NEEDLE_UNROLL - 1) * (long long)R < r1; i += NEEDLE_UNROLL * R) {
        Vec<In, W> x[NEEDLE_UNROLL];
#pragma unroll
        for (int u = 0; u < NEEDLE_UNROLL; ++u) x[u] = v[(i + u * (long long)R) * groups + g];
#pragma unroll
        for (int u = 0; u < NEEDLE_UNROLL; ++u) combine_vec<Op>(acc, x[u]);  // rows in order
      }
      for (; i < r1; i += R) combine_vec<Op>(acc, v[i * groups + g]);
    }
    Out* dst = out + chunk * n + g * W;
    if (R == 1) {
      if (g < groups) {
#pragma unroll
        for (int w = 0; w < W; ++w) dst[w] = Convert<Out, A>::apply(acc[w]);
      }
      continue;
    }
#pragma unroll
    for (int w = 0; w < W; ++w) part[threadIdx.x * W + w] = acc[w];
    __syncthreads();
    if (rl == 0 && g < groups) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        A s = part[cl * W + w];
        for (int r = 1; r < R; ++r) {
          s = Op::template combine<A>(s, part[(r * lanes + cl) * W + w]);
        }
        dst[w] = Convert<Out, A>::apply(s);
      }
    }
    __syncthreads();  // part is rewritten by the next iteration
  }
}

template <typename In, typename Out, typename Op>
__device__ __forceinline__ void leading(const In* __restrict__ a, Out* __restrict__ out,
                                        long long m, long long n, long long lanes,
                                        long long chunks, long long width) {
  // The launcher passes only widths whose vector fits 16 bytes.
  if (width == 8) {
    leading_body<8, In, Out, Op>(a, out, m, n, (int)lanes, chunks);
  } else if (width == 4) {
    leading_body<4, In, Out, Op>(a, out, m, n, (int)lanes, chunks);
  } else if (width == 2) {
    leading_body<2, In, Out, Op>(a, out, m, n, (int)lanes, chunks);
  } else {
    leading_body<1, In, Out, Op>(a, out, m, n, (int)lanes, chunks);
  }
}

#define NEEDLE_LEADING_T(NAME, OP, SUF, T)                                                   \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_##NAME##_leading_##SUF(const T* __restrict__ a, T* __restrict__ out,            \
                                    long long m, long long n, long long lanes,               \
                                    long long chunks, long long width) {                     \
    leading<T, T, OP>(a, out, m, n, lanes, chunks, width);                                   \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_##NAME##_leading_partial_##SUF(const T* __restrict__ a,                         \
                                            Traits<T>::acc* __restrict__ out, long long m,   \
                                            long long n, long long lanes, long long chunks,  \
                                            long long width) {                               \
    leading<T, Traits<T>::acc, OP>(a, out, m, n, lanes, chunks, width);                      \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      reduce_##NAME##_leading_final_##SUF(const Traits<T>::acc* __restrict__ a,              \
                                          T* __restrict__ out, long long m, long long n,     \
                                          long long lanes, long long chunks,                 \
                                          long long width) {                                 \
    leading<Traits<T>::acc, T, OP>(a, out, m, n, lanes, chunks, width);                      \
  }

#define NEEDLE_SUM_LEADING_T(SUF, T) NEEDLE_LEADING_T(sum, RedSum, SUF, T)

// Every reduction kernel for one dtype; a new dtype is one more line below.
#define NEEDLE_REDUCE_DTYPE(SUF, T)      \
  NEEDLE_REDUCE_T(sum, RedSum, SUF, T)   \
  NEEDLE_REDUCE_T(max, RedMax, SUF, T)   \
  NEEDLE_REDUCE_T(min, RedMin, SUF, T)   \
  NEEDLE_SUM_LEADING_T(SUF, T)           \
  NEEDLE_LEADING_T(max, RedMax, SUF, T)  \
  NEEDLE_LEADING_T(min, RedMin, SUF, T)

NEEDLE_REDUCE_DTYPE(f32, float)
NEEDLE_REDUCE_DTYPE(f64, double)
NEEDLE_REDUCE_DTYPE(f16, half_t)
NEEDLE_REDUCE_DTYPE(bf16, bf16_t)
