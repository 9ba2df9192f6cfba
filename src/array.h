// The backend's Array: a flat buffer of `size` elements of one dtype, held as one block of the
// caching allocator (allocator.h) and charged to a memory category.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "allocator.h"
#include "common.h"

namespace needle {

class Array {
 public:
  Array(std::int64_t size, DType dtype, Category cat) : dtype_(dtype) {
    if (size < 0) {
      throw ShapeArgError("Array: size must be >= 0, got " + std::to_string(size));
    }
    size_ = std::size_t(size);
    // Checked before multiplying: size * itemsize must not wrap into a small block.
    if (size_ > kMaxBufferBytes / itemsize(dtype)) {
      throw SizeLimitError("Array: buffer too large, expected at most " +
                           std::to_string(kMaxBufferBytes) + " bytes (2**62), got " +
                           std::to_string(size_) + " elements of " + dtype_name(dtype) + " (" +
                           std::to_string(itemsize(dtype)) + " bytes each)");
    }
    const std::size_t nbytes = size_ * itemsize(dtype);
    try {
      // Blocks are at least 512 bytes, so aligned tile loads never run off a tiny buffer.
      block_ = mem::allocate(nbytes, cat);
    } catch (const LimitExceeded&) {
      throw;  // a limit set by needle.memory.set_limit: its own report names what is live
    } catch (const std::bad_alloc&) {
      throw OutOfMemory("Array: out of memory, expected a buffer of " + std::to_string(nbytes) +
                        " bytes, got a refusal from the system");
    }
    ptr_ = mem::data(block_);
  }
  ~Array() { mem::release(block_); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;

  std::size_t size() const { return size_; }
  DType dtype() const { return dtype_; }
  void* data() { return ptr_; }
  const void* data() const { return ptr_; }
  Block* block() const { return block_; }

 private:
  Block* block_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
  DType dtype_;
};

}  // namespace needle
