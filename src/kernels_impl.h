// Body shared by kernels_base.cc and kernels_avx2.cc: the includer defines NEEDLE_ISA (the
// namespace) and compiles this with its own instruction-set flags.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "allocator.h"
#include "kernels.h"

namespace needle {
namespace NEEDLE_ISA {

#include "elementwise_impl.h"
#include "reductions_impl.h"
#include "matmul_impl.h"

extern const KernelTable table = {
    NEEDLE_ISA_NAME, binary, scalar, unary, cast, reduce, matmul, matmul_strided,
};

}  // namespace NEEDLE_ISA
}  // namespace needle
