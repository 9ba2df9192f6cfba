// The run-time choice of a kernel table (kernels.h): the best instruction set the CPU runs,
// or one forced by name (NEEDLE_CPU_ISA, the backend's private _set_isa) for tests/benches.
#pragma once

#include <string>
#include <vector>

#include "kernels.h"

namespace needle {

// "auto" gives the widest build this CPU can run (avx512, then avx2, then baseline); a build
// name gives that build or throws std::invalid_argument naming what the CPU lacks.
const KernelTable& select_isa(const std::string& name);

// The builds this CPU can run, widest first ("baseline" always last).
std::vector<std::string> available_isas();

}  // namespace needle
