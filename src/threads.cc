// Kernel thread count (set_num_threads / get_num_threads of the backend protocol).
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common.h"

namespace needle {

namespace {
int initial_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();  // honours OMP_NUM_THREADS
#else
  return 1;
#endif
}
std::atomic<int> g_threads{initial_threads()};

bool same_word(const char* a, const char* b) {
  for (; *a && *b; ++a, ++b) {
    if (std::tolower(static_cast<unsigned char>(*a)) != *b) return false;
  }
  return !*a && !*b;
}

// libgomp's spin count (pause-loop iterations an idle worker waits before it sleeps), by the
// rule libgomp applies when it loads: GOMP_SPINCOUNT (a number with an optional k/M/G/T
// suffix, or "infinite"), else 3e10 for OMP_WAIT_POLICY=active, 0 for passive, 3e5 unset.
// needle's Python layer leaves these variables alone when libgomp was loaded before it
// (import torch first), so they are what libgomp read.
double spin_count_from_environment() {
  if (const char* spin = std::getenv("GOMP_SPINCOUNT")) {
    if (same_word(spin, "infinite") || same_word(spin, "infinity")) return 1e30;
    char* end = nullptr;
    double value = std::strtod(spin, &end);
    if (end != spin) {
      switch (std::tolower(static_cast<unsigned char>(*end))) {
        case 'k': value *= 1e3; break;
        case 'm': value *= 1e6; break;
        case 'g': value *= 1e9; break;
        case 't': value *= 1e12; break;
        default: break;
      }
      return value;
    }
  }
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  if (policy && same_word(policy, "active")) return 3e10;
  if (policy && same_word(policy, "passive")) return 0;
  return 3e5;
}

// Read while the module loads: needle removes the variables it chose once libgomp has them.
// 1000 iterations lasted 20-40 us on the VMs measured, so 1e4 is some 0.2-0.4 ms: longer
// than the host code between two kernels of a training step, so the second thread is still
// awake when the next product starts.
const double g_parallel_min_flops = spin_count_from_environment() >= 1e4 ? 5e5 : 2e6;
}  // namespace

double parallel_min_flops() { return g_parallel_min_flops; }

int num_threads() { return g_threads.load(std::memory_order_relaxed); }

void set_num_threads(int n) {
  if (n < 1) {
    throw std::invalid_argument("set_num_threads: expected a thread count >= 1, got " +
                                std::to_string(n));
  }
#ifdef _OPENMP
  g_threads.store(n, std::memory_order_relaxed);
#endif
}

}  // namespace needle
