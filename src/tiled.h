// The course's tiled matmul (matmul_tiled in the backend protocol).
#pragma once

#include <cstddef>

#include "kernels.h"

namespace needle {

// a is (m/T, n/T, T, T), b (n/T, p/T, T, T), out (m/T, p/T, T, T), all compact, T = tile;
// out arrives uninitialised. m, n, p are multiples of tile (checked by the caller).
void matmul_tiled(const KernelTable& k, DType t, const void* a, const void* b, void* out,
                  std::size_t m, std::size_t n, std::size_t p, std::size_t tile);

}  // namespace needle
