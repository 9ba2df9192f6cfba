// Fused kernels of the optional protocol (docs/backend_protocol.md): softmax cross-entropy
// from class labels, and embedding row lookup, forward and backward.
//
// Labels and ids arrive in the kernel's dtype. The launcher (ndarray_backend_cuda.py) checks
// them on the host only at the next synchronisation of the device (reading them at the launch
// would stall the queue twice per training step), so a kernel meets bad ones: it reads
// nothing out of bounds and writes NaN where the value would have come from a bad label
// (the backward scatter skips a bad id). Only float32 and float64 are instantiated (the ops
// use these kernels for those dtypes and compute float16 with array ops).
#include "common.cuh"

// ``label`` as an index when it is an integer in [0, limit), else -1 (NaN included).
template <typename T>
__device__ __forceinline__ long long class_index(T label, long long limit) {
  typedef typename Traits<T>::acc A;
  const A v = Traits<T>::load(label);
  if (!(v >= A(0)) || !(v < A(limit))) return -1;
  const long long i = (long long)v;
  return A(i) == v ? i : -1;
}

template <typename A>
__device__ __forceinline__ A quiet_nan() {
  return m_sqrt(A(-1));
}

// One block per row (grid-stride over rows): lse = max + log(sum exp(z - max)) and
// loss = lse - z[label], in the compute type.
template <typename T>
__device__ __forceinline__ void softmax_xent_forward_body(const T* __restrict__ z,
                                                          const T* __restrict__ labels,
                                                          T* __restrict__ loss,
                                                          T* __restrict__ lse, long long n,
                                                          long long k) {
  typedef typename Traits<T>::acc A;
  __shared__ A row_max;
  for (long long row = blockIdx.x; row < n; row += gridDim.x) {
    const T* zr = z + row * k;
    A m = RedMax::template identity<A>();
    for (long long j = threadIdx.x; j < k; j += blockDim.x) {
      m = nan_max(m, Traits<T>::load(zr[j]));
    }
    m = block_reduce<A, RedMax>(m);
    if (threadIdx.x == 0) row_max = m;
    __syncthreads();
    m = row_max;
    A s = A(0);
    for (long long j = threadIdx.x; j < k; j += blockDim.x) {
      s += m_exp(Traits<T>::load(zr[j]) - m);
    }
    s = block_reduce<A, RedSum>(s);
    if (threadIdx.x == 0) {
      const A total = m + m_log(s);
      const long long y = class_index(labels[row], k);
      lse[row] = Traits<T>::store(total);
      loss[row] = Traits<T>::store(y >= 0 ? total - Traits<T>::load(zr[y]) : quiet_nan<A>());
    }
    __syncthreads();  // row_max is written again for the next row
  }
}

// dz = g (softmax(z) - onehot(label)) per element of the (n, k) logits, from the saved lse.
template <typename T>
__device__ __forceinline__ void softmax_xent_backward_body(
    const T* __restrict__ z, const T* __restrict__ labels, const T* __restrict__ lse,
    const T* __restrict__ g, T* __restrict__ dz, long long n, long long k) {
  typedef typename Traits<T>::acc A;
  NEEDLE_FOR_EACH(i, n * k) {
    const long long row = i / k, j = i - row * k;
    const long long y = class_index(labels[row], k);
    A v = m_exp(Traits<T>::load(z[i]) - Traits<T>::load(lse[row]));
    if (j == y) v -= A(1);
    dz[i] = Traits<T>::store(y >= 0 ? v * Traits<T>::load(g[row]) : quiet_nan<A>());
  }
}

// out[i, d] = table[ids[i], d] for n ids over a (num, dim) table.
template <typename T>
__device__ __forceinline__ void embedding_forward_body(const T* __restrict__ table,
                                                       const T* __restrict__ ids,
                                                       T* __restrict__ out, long long num,
                                                       long long dim, long long n) {
  NEEDLE_FOR_EACH(i, n * dim) {
    const long long pos = i / dim, d = i - pos * dim;
    const long long r = class_index(ids[pos], num);
    out[i] = r >= 0 ? table[r * dim + d] : Traits<T>::store(quiet_nan<typename Traits<T>::acc>());
  }
}

// dtable[r, d] = sum of g[p, d] over the positions p with ids[p] == r, added in position
// order (as numpy.add.at does): one thread per table element scans the ids, so no atomics
// and the same sum on every run.
template <typename T>
__device__ __forceinline__ void embedding_backward_body(const T* __restrict__ g,
                                                        const T* __restrict__ ids,
                                                        T* __restrict__ dtable, long long num,
                                                        long long dim, long long n) {
  typedef typename Traits<T>::acc A;
  NEEDLE_FOR_EACH(i, num * dim) {
    const long long r = i / dim, d = i - r * dim;
    A acc = A(0);
    for (long long p = 0; p < n; ++p) {
      if (class_index(ids[p], num) == r) acc += Traits<T>::load(g[p * dim + d]);
    }
    dtable[i] = Traits<T>::store(acc);
  }
}

#define NEEDLE_FUSED_T(SUF, T)                                                                \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) softmax_xent_forward_##SUF(    \
      const T* __restrict__ z, const T* __restrict__ labels, T* __restrict__ loss,             \
      T* __restrict__ lse, long long n, long long k) {                                        \
    softmax_xent_forward_body<T>(z, labels, loss, lse, n, k);                                 \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) softmax_xent_backward_##SUF(   \
      const T* __restrict__ z, const T* __restrict__ labels, const T* __restrict__ lse,       \
      const T* __restrict__ g, T* __restrict__ dz, long long n, long long k) {                 \
    softmax_xent_backward_body<T>(z, labels, lse, g, dz, n, k);                               \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) embedding_forward_##SUF(       \
      const T* __restrict__ table, const T* __restrict__ ids, T* __restrict__ out,            \
      long long num, long long dim, long long n) {                                            \
    embedding_forward_body<T>(table, ids, out, num, dim, n);                                  \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS) embedding_backward_##SUF(      \
      const T* __restrict__ g, const T* __restrict__ ids, T* __restrict__ dtable,             \
      long long num, long long dim, long long n) {                                            \
    embedding_backward_body<T>(g, ids, dtable, num, dim, n);                                  \
  }

NEEDLE_FUSED_T(f32, float)
NEEDLE_FUSED_T(f64, double)
