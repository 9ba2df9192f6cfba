// The caching allocator of the C++ CPU backend, with exact statistics per memory category.
//
// Every buffer the backend owns comes from here: Array storage through mem::allocate (a Block
// handle, charged to a category) and kernel workspaces through needle_alloc/needle_free
// (charged to "workspace"). The size classes are those of the Python CachingAllocator
// (needle/memory/caching_allocator.py, docs/memory.md), so both report the same numbers for
// the same sequence of requests:
//
//  * block size = request rounded up to a multiple of 512 B (0 B takes 512 B);
//  * small pool (block <= 1 MiB): blocks are cut from 2 MiB segments;
//  * large pool (block > 1 MiB): a fresh segment is the block rounded up to 2 MiB; a cut keeps
//    the remainder as a free block only if it exceeds 1 MiB, else the whole block is handed out;
//  * reuse is best fit within the pool (LIFO among equal sizes); freed neighbours coalesce;
//    empty_cache() returns the segments that are entirely free.
//
// Segments are 2 MiB-aligned anonymous mappings; large ones are advised MADV_HUGEPAGE (first
// touch of a fresh 40 MB buffer was measured at 25-34 ms against 2.5 ms to refill one). All functions are thread-safe (one
// mutex); none of them touches Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace needle {

// Alignment of every block: enough for AVX-512 loads and for the course's tile loads.
constexpr std::size_t kAlignment = 256;

constexpr std::size_t kBlockRound = 512;
constexpr std::size_t kSmallLimit = std::size_t(1) << 20;
constexpr std::size_t kSmallSegment = std::size_t(2) << 20;
constexpr std::size_t kLargeRound = std::size_t(2) << 20;
constexpr std::size_t kMinLargeSplit = std::size_t(1) << 20;
// Largest request: rounding it up to a block, a segment and the mapping's alignment slack
// cannot wrap. Array asks for at most 2**62 bytes (common.h kMaxBufferBytes).
constexpr std::size_t kMaxRequest = std::size_t(1) << 62;

// The memory categories of docs/memory.md, in the order of needle.memory.categories.CATEGORIES.
// `master` holds an optimizer's float32 master copies of float16 parameters; `optimizer_temp`
// the temporaries of an optimizer update.
enum class Category : std::uint8_t {
  weight, gradient, optimizer, master, optimizer_temp, activation, workspace, other
};
constexpr int kNumCategories = 8;

const char* category_name(Category c) noexcept;
// Sets *out and returns true when `name` is a category name.
bool parse_category(const std::string& name, Category* out) noexcept;
// "['weight', 'gradient', ...]" for error messages.
std::string category_list();

struct Block;  // opaque handle to a live block

// Thrown when a request would take the reserved bytes past the limit set with mem::set_limit
// (after the cache was emptied). Carries what an out-of-memory report needs.
struct LimitExceeded : std::bad_alloc {
  std::size_t requested = 0, block = 0, segment = 0;  // bytes asked, rounded block, new segment
  std::int64_t allocated = 0, reserved = 0, limit = 0, largest_free = 0;
  Category category = Category::other;
  const char* what() const noexcept override { return "needle allocator: limit exceeded"; }
};

namespace mem {

// A live block of at least `requested` bytes charged to `cat`; throws std::bad_alloc when the
// system has no memory left even after the cache was emptied, std::length_error when
// `requested` exceeds kMaxRequest.
Block* allocate(std::size_t requested, Category cat);
// Returns `b` to the cache (exactly once; the handle may be handed out again afterwards).
// (allocate throws LimitExceeded, a std::bad_alloc, when a limit is set and would be passed.)
void release(Block* b) noexcept;
// Moves a live block's bytes to category `cat` (an event is recorded when it changes).
void retag(Block* b, Category cat) noexcept;

void* data(const Block* b) noexcept;
std::uint64_t block_id(const Block* b) noexcept;
std::size_t block_size(const Block* b) noexcept;
Category block_category(const Block* b) noexcept;

struct CategoryCounters {
  std::int64_t current = 0, peak = 0, current_requested = 0, peak_requested = 0;
};

struct Stats {
  std::int64_t allocated = 0, requested = 0, peak = 0, peak_requested = 0;
  std::int64_t reserved = 0, peak_reserved = 0;
  std::int64_t num_allocs = 0, num_frees = 0, num_reused = 0;
  std::int64_t num_segments = 0, num_segment_allocs = 0, num_segment_frees = 0;
  CategoryCounters by_category[kNumCategories];
};

Stats stats();
void reset_peak();
// Unmaps every wholly free segment; returns the bytes released.
std::size_t empty_cache();

// Refuse a new segment that would take the reserved bytes past `bytes` (0: no limit).
void set_limit(std::size_t bytes);
std::size_t limit();
// The largest cached free block (bytes), the measure of fragmentation an OOM report quotes.
std::size_t largest_free_block();

struct LiveBlock {
  std::uint64_t id;
  std::int64_t size, requested;
  Category category;
};
// Every block in use now, in segment order.
std::vector<LiveBlock> live_blocks();

// ---- planned runs (needle.memory's Plan.run on cpu) -----------------------------------
//
// Between plan_begin and plan_end the k-th request made by the thread that called plan_begin
// (others, e.g. data loaders, are served from the pools), of a category other than
// "workspace" (kernel scratch, allocated by worker threads in no fixed order), is served by
// entry k: at
// `offset` in one arena block allocated by plan_begin (`size` bytes, released as a no-op), or
// from the pools when `offset` is -1 (a buffer that outlives the run). A request whose size
// differs from its entry, one past the last entry, or a planned buffer whose bytes are still
// held by a live one (a lifetime longer than traced) makes the run *diverge*: that request and
// every later one are served from the pools, so results stay right, and plan_end reports it.
// The arena is released once plan_end ran and its last planned buffer was released.
struct PlanEntry {
  std::size_t requested;
  std::int64_t offset;  // -1: served from the pools
  std::size_t size;     // bytes reserved at offset (>= requested)
};
struct PlanResult {
  std::int64_t count;     // requests seen
  std::int64_t diverged;  // index of the first request off the plan, -1 if none
  std::string reason;     // empty when the run followed the plan exactly
};
// Throws std::logic_error when a planned run is already in progress, std::invalid_argument
// when an entry does not fit in the arena.
void plan_begin(std::size_t arena_bytes, std::vector<PlanEntry> entries);
PlanResult plan_end();

// ---- event log (the timeline of needle.memory.record) ----------------------------------

enum class EventKind : std::uint8_t { alloc, free, retag };

struct Event {
  EventKind kind;
  Category category;       // after the event
  Category prev_category;  // before a retag (meaningless otherwise)
  bool new_segment;
  std::uint64_t block;
  std::int64_t nbytes;     // block size
  std::int64_t requested;
  std::int64_t allocated;  // allocated bytes after the event
  int op;                  // interned op name, -1 for none
};

// Switches the log on or off; returns the previous state. The log keeps growing while on.
bool set_recording(bool on);
// The logged events, oldest first; `clear` empties the log.
std::vector<Event> events(bool clear);

// Op names attached to events: interned once, then set per thread by index.
int intern_op(const std::string& name);
std::string op_name(int op);
// Sets this thread's op (-1: none); returns the previous one.
int set_thread_op(int op) noexcept;

}  // namespace mem

// Kernel workspaces: a kAlignment-aligned block of at least `bytes` bytes charged to
// "workspace" (a 0-byte request still returns a valid, freeable block). Throws std::bad_alloc.
void* needle_alloc(std::size_t bytes);
// Releases a block returned by needle_alloc. nullptr is ignored.
void needle_free(void* ptr) noexcept;

}  // namespace needle
