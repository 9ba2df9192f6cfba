// The fused elementwise kernel's entry (ndarray_backend_program.cc), shared by its pybind
// function and the C++ kernel list (kernel_list_py.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "array.h"
#include "kernels.h"

namespace needle {

// Throws std::invalid_argument unless `code` is a well-formed program (ewise_program_impl.h)
// over n_in inputs, n_out outputs and n_scalars scalars.
void check_ewise_program(const std::vector<std::int32_t>& code, std::size_t n_in,
                         std::size_t n_out, std::size_t n_scalars);

// Throws std::invalid_argument unless a program whose output `out` is input `in`'s buffer
// reads that input only up to the output's store (the program runs in place).
void check_in_place(const std::vector<std::int32_t>& code, std::size_t in, std::size_t out);

// Checks the arrays (dtype, size, an output sharing an input's buffer only where
// check_in_place allows it), the program unless `checked`, then runs it on `kernels` with
// the GIL released.
void run_ewise_program(const KernelTable& kernels, const std::vector<const Array*>& ins,
                       const std::vector<Array*>& outs, const std::vector<std::int32_t>& code,
                       const std::vector<double>& scalars, std::int64_t n, bool checked);

}  // namespace needle
