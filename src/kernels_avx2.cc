// AVX2 + FMA + F16C build of the kernels: CMakeLists.txt gives this file alone
// -mavx2 -mfma -mf16c; it only runs after __builtin_cpu_supports confirmed those features.
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "kernels_avx2.cc must be compiled with -mavx2 -mfma -mf16c"
#endif
#define NEEDLE_ISA avx2
#define NEEDLE_ISA_NAME "avx2"
#include "kernels_impl.h"
