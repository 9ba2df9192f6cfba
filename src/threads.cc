// Kernel thread count (set_num_threads / get_num_threads of the backend protocol).
#include <atomic>
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
}  // namespace

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
