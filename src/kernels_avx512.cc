// AVX-512 (F, BW, DQ, VL) build of the kernels, with FMA and F16C: CMakeLists.txt gives this
// file alone -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma -mf16c; it only runs
// after __builtin_cpu_supports confirmed those features (and the OS saves the zmm state).
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512DQ__) || \
    !defined(__AVX512VL__) || !defined(__FMA__) || !defined(__F16C__)
#error "kernels_avx512.cc must be compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl"
#endif
// GCC 12 warns about the deliberately undefined source operand of some AVX-512 intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define NEEDLE_ISA avx512
#define NEEDLE_ISA_NAME "avx512"
#include "kernels_impl.h"
