// Binding of the random-draw kernel of the C++ CPU backend (mt19937_uniform), kept apart from
// ndarray_backend_cpu.cc: the module calls bind_random once with its kernel-table pointer.
#pragma once

#include <pybind11/pybind11.h>

#include "array_py.h"  // the Array caster: every binding must see the same one
#include "kernels.h"

namespace needle {

void bind_random(pybind11::module_& m, const KernelTable* const* kernels);

}  // namespace needle
