// Body shared by kernels_base.cc, kernels_avx2.cc and kernels_avx512.cc: the includer defines
// NEEDLE_ISA (the namespace) and compiles this with its own instruction-set flags.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "allocator.h"
#include "kernels.h"
#include "strided.h"

namespace needle {
namespace NEEDLE_ISA {

#include "simd_vec_impl.h"
#include "elementwise_impl.h"
#include "ewise_program_impl.h"
#include "reductions_impl.h"
#include "matmul_impl.h"
#include "conv_impl.h"
#include "lstm_impl.h"
#include "batchnorm_impl.h"
#include "softmax_xent_impl.h"
#include "mt19937_impl.h"

extern const KernelTable table = {
    NEEDLE_ISA_NAME, binary, scalar, unary, cast, reduce, sum_leading, matmul, matmul_strided,
    conv_forward, conv_weight_grad, conv_input_grad, lstm_forward, lstm_backward,
    bn_forward, bn_backward, xent_forward, xent_backward, ewise_program, uniform_fill,
    GemmConfig<float>::name, GemmConfig<double>::name,
};

}  // namespace NEEDLE_ISA
}  // namespace needle
