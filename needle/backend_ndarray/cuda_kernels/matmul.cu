// Matrix products: our own shared-memory tiled, register-blocked GEMM, and the course's
// tiled-layout product (matmul_tiled). The default path for `matmul` is cuBLAS through CuPy;
// this kernel is the one we own and measure against it (docs/cuda.md).
#include "common.cuh"

// C (M x N) = A (M x K) @ B (K x N), all compact row-major.
//
// A block of 256 threads computes a BM x BN tile of C. For each step of BK along K, the block
// stages A's BM x BK slab (transposed, so that the inner loop reads it along M) and B's
// BK x BN slab in shared memory; each thread then accumulates a TM x TN register block from
// TM values of A and TN of B per k (TM*TN FMAs for TM+TN shared loads).
// A thread owns rows ty + i*TY and columns tx + j*TX (interleaved rather than contiguous) so
// that a warp reads consecutive shared-memory words of B and writes consecutive columns of C.
// As is padded by 4 columns so that the transposing store does not hit one bank 8 times.
// Out-of-range loads read zero and stores are guarded, so any M, K, N works.
template <typename T, int BM, int BN, int BK, int TM, int TN>
__device__ __forceinline__ void gemm_body(const T* __restrict__ A, const T* __restrict__ B,
                                          T* __restrict__ C, long long M, long long K,
                                          long long N) {
  typedef typename Traits<T>::acc Acc;
  constexpr int TX = BN / TN;
  constexpr int TY = BM / TM;
  constexpr int NT = TX * TY;
  static_assert(NT == NEEDLE_THREADS, "the tile shape must give 256 threads");
  static_assert((BM * BK) % NT == 0 && (BK * BN) % NT == 0, "slabs must split evenly");
  __shared__ Acc As[BK][BM + 4];
  __shared__ Acc Bs[BK][BN];

  const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
  const long long row0 = (long long)blockIdx.y * BM, col0 = (long long)blockIdx.x * BN;
  Acc acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = Acc(0);

  for (long long k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int q = 0; q < BM * BK / NT; ++q) {
      const int idx = tid + q * NT, r = idx / BK, c = idx % BK;
      const long long gr = row0 + r, gc = k0 + c;
      As[c][r] = (gr < M && gc < K) ? Traits<T>::load(A[gr * K + gc]) : Acc(0);
    }
#pragma unroll
    for (int q = 0; q < BK * BN / NT; ++q) {
      const int idx = tid + q * NT, r = idx / BN, c = idx % BN;
      const long long gr = k0 + r, gc = col0 + c;
      Bs[r][c] = (gr < K && gc < N) ? Traits<T>::load(B[gr * N + gc]) : Acc(0);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      Acc ra[TM], rb[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) ra[i] = As[kk][ty + i * TY];
#pragma unroll
      for (int j = 0; j < TN; ++j) rb[j] = Bs[kk][tx + j * TX];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const long long r = row0 + ty + i * TY;
    if (r >= M) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const long long c = col0 + tx + j * TX;
      if (c < N) C[r * N + c] = Traits<T>::store(acc[i][j]);
    }
  }
}

// Tile shapes: keep them in sync with MATMUL_TILES in needle/backend_ndarray/_cuda/launch.py,
// which computes the grid. float, float16 and bfloat16 (computed in float): 128 x 128 tiles,
// 8 x 8 per thread; double: 64 x 64 tiles, 4 x 4 per thread (twice the registers per value).
extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    matmul_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
               long long m, long long n, long long p) {
  gemm_body<float, 128, 128, 8, 8, 8>(a, b, out, m, n, p);
}
extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    matmul_f16(const half_t* __restrict__ a, const half_t* __restrict__ b,
               half_t* __restrict__ out, long long m, long long n, long long p) {
  gemm_body<half_t, 128, 128, 8, 8, 8>(a, b, out, m, n, p);
}
extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    matmul_bf16(const bf16_t* __restrict__ a, const bf16_t* __restrict__ b,
                bf16_t* __restrict__ out, long long m, long long n, long long p) {
  gemm_body<bf16_t, 128, 128, 8, 8, 8>(a, b, out, m, n, p);
}
extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)
    matmul_f64(const double* __restrict__ a, const double* __restrict__ b,
               double* __restrict__ out, long long m, long long n, long long p) {
  gemm_body<double, 64, 64, 8, 4, 4>(a, b, out, m, n, p);
}

// The course's tiled layout (the backend protocol's matmul_tiled, docs/backend_protocol.md):
// a is (m/T, n/T, T, T), b is (n/T, p/T, T, T), out is (m/T, p/T, T, T), all compact.
// One thread per output element; out arrives uninitialised and every element is written.
template <typename T>
__device__ __forceinline__ void matmul_tiled_body(const T* __restrict__ a,
                                                  const T* __restrict__ b, T* __restrict__ out,
                                                  long long m, long long n, long long p,
                                                  long long tile) {
  typedef typename Traits<T>::acc A;
  const long long n_tiles = n / tile, p_tiles = p / tile;
  NEEDLE_FOR_EACH(idx, m * p) {
    // idx enumerates out in its own (i, j, r, c) layout.
    long long c = idx % tile, r = (idx / tile) % tile;
    long long j = (idx / (tile * tile)) % p_tiles, i = idx / (tile * tile * p_tiles);
    A acc = A(0);
    for (long long k = 0; k < n_tiles; ++k) {
      const T* at = a + ((i * n_tiles + k) * tile + r) * tile;  // row r of tile (i, k)
      const T* bt = b + ((k * p_tiles + j) * tile) * tile + c;  // column c of tile (k, j)
      for (long long t = 0; t < tile; ++t) {
        acc += Traits<T>::load(at[t]) * Traits<T>::load(bt[t * tile]);
      }
    }
    out[idx] = Traits<T>::store(acc);
  }
}

#define NEEDLE_TILED_T(SUF, T)                                                               \
  extern "C" __global__ void __launch_bounds__(NEEDLE_THREADS)                               \
      matmul_tiled_##SUF(const T* __restrict__ a, const T* __restrict__ b,                   \
                         T* __restrict__ out, long long m, long long n, long long p,         \
                         long long tile) {                                                   \
    matmul_tiled_body<T>(a, b, out, m, n, p, tile);                                          \
  }

NEEDLE_TILED_T(f32, float)
NEEDLE_TILED_T(f64, double)
NEEDLE_TILED_T(f16, half_t)
NEEDLE_TILED_T(bf16, bf16_t)
