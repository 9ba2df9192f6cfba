// Kernels that move elements between compact buffers and strided views. They depend only
// on the element size, not on the instruction set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"

namespace needle {

using Dims = std::vector<std::int64_t>;

// A strided view of a flat buffer: element (i0, i1, ...) lives at offset + sum(ik * strides[k]).
struct View {
  Dims shape;
  Dims strides;
  std::int64_t offset;
};

// The element count of view `v` of a `buffer_size`-element buffer. Throws ShapeArgError for a
// malformed view, SizeLimitError past 2**62 elements and BoundsError when any element (or the
// arithmetic that finds it) would fall outside the buffer (common.h); an empty view is valid
// with any strides.
std::size_t check_view(const char* op, const View& v, std::size_t buffer_size);

// out[0..n) = the elements of view `v` of `src`, in row-major order.
void gather(std::size_t elem_bytes, const void* src, const View& v, void* out);
// The elements of view `v` of `dst` = src[0..n), in row-major order.
void scatter(std::size_t elem_bytes, const void* src, const View& v, void* dst);
// Every element of view `v` of `dst` = the element whose bytes are at `value`.
void scatter_value(std::size_t elem_bytes, const void* value, const View& v, void* dst);

}  // namespace needle
