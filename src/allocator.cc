#include "allocator.h"

#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace needle {

namespace {
// Blocks from this size on ask the kernel for transparent huge pages: first touch of a fresh
// large buffer otherwise costs one page fault per 4 KiB (PERF_NOTES: 25-34 ms for 40 MB).
constexpr std::size_t kHugePageThreshold = std::size_t(1) << 21;

std::size_t round_up(std::size_t bytes, std::size_t to) { return (bytes + to - 1) / to * to; }
}  // namespace

void* needle_alloc(std::size_t bytes) {
  const bool huge = bytes >= kHugePageThreshold;
  // Huge blocks are aligned to 2 MiB so whole huge pages can back them.
  const std::size_t align = huge ? kHugePageThreshold : kAlignment;
  const std::size_t size = round_up(bytes == 0 ? kAlignment : bytes, align);
  void* ptr = std::aligned_alloc(align, size);
  if (ptr == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge) madvise(ptr, size, MADV_HUGEPAGE);  // advisory: failure is harmless
#endif
  return ptr;
}

void needle_free(void* ptr) noexcept { std::free(ptr); }

}  // namespace needle
