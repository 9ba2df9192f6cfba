// Bindings of the fused kernels (convolution; LSTM cell) of the C++ CPU backend, kept apart
// from ndarray_backend_cpu.cc: the module calls bind_fused once with its kernel-table pointer.
#pragma once

#include <pybind11/pybind11.h>

#include "array_py.h"  // the Array caster: every binding must see the same one
#include "kernels.h"

namespace needle {

// Adds conv2d_forward / conv2d_weight_grad / conv2d_input_grad (and the LSTM cell kernels) to
// module `m`; each call runs the table `*kernels` points to at that moment.
void bind_fused(pybind11::module_& m, const KernelTable* const* kernels);

}  // namespace needle
