// The one allocation function pair of the C++ CPU backend.
//
// Every buffer the backend owns (Array storage and kernel workspaces) is obtained from
// needle_alloc and returned to needle_free, so that a later caching allocator with statistics
// only has to replace these two functions.
#pragma once

#include <cstddef>

namespace needle {

// Alignment of every block: enough for AVX-512 loads and for the course's tile loads.
constexpr std::size_t kAlignment = 256;

// Returns a kAlignment-aligned block of at least `bytes` bytes (a 0-byte request still
// returns a valid, freeable block). Throws std::bad_alloc when the system is out of memory.
void* needle_alloc(std::size_t bytes);

// Releases a block returned by needle_alloc. nullptr is ignored.
void needle_free(void* ptr) noexcept;

}  // namespace needle
