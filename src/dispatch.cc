#include "dispatch.h"

#include <stdexcept>

namespace needle {

namespace {

bool cpu_has_avx2() {
#ifdef NEEDLE_HAVE_AVX2_TABLE
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// libgcc's cpu model reports AVX-512 only when the OS also saves the zmm/opmask state (XCR0).
bool cpu_has_avx512() {
#ifdef NEEDLE_HAVE_AVX512_TABLE
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

}  // namespace

const KernelTable& select_isa(const std::string& name) {
#ifdef NEEDLE_HAVE_AVX512_TABLE
  if ((name == "avx512" || name == "auto") && cpu_has_avx512()) return avx512::table;
  if (name == "avx512") {
    throw std::invalid_argument("_set_isa: expected a CPU with AVX-512 F/BW/DQ/VL for 'avx512', "
                                "this one (or this build) lacks it");
  }
#endif
#ifdef NEEDLE_HAVE_AVX2_TABLE
  if ((name == "avx2" || name == "auto") && cpu_has_avx2()) return avx2::table;
  if (name == "avx2") {
    throw std::invalid_argument("_set_isa: expected a CPU with AVX2/FMA/F16C for 'avx2', "
                                "this one lacks it");
  }
#endif
  if (name == "baseline" || name == "auto") return base::table;
  throw std::invalid_argument("_set_isa: expected 'auto', 'avx512', 'avx2' or 'baseline', got '" +
                              name + "'");
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  if (cpu_has_avx512()) names.push_back("avx512");
  if (cpu_has_avx2()) names.push_back("avx2");
  names.push_back("baseline");
  return names;
}

}  // namespace needle
