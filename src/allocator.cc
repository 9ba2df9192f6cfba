// The caching allocator (see allocator.h for the size classes). It mirrors
// needle/memory/caching_allocator.py step for step, ids included, so that the Python allocator
// is an exact oracle for it in the tests.
#include "allocator.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__unix__)
#include <pthread.h>
#endif

namespace needle {

namespace {

const char* const kCategoryNames[kNumCategories] = {
    "weight", "gradient", "optimizer", "master", "optimizer_temp", "activation", "workspace",
    "other"};

enum Pool { kSmall = 0, kLarge = 1 };

struct Segment {
  std::uint64_t id;
  char* base;
  std::size_t size;
  Pool pool;
  Block* head;  // the offset-0 block: absorption keeps the lower block, so it stays valid
  Segment* prev;
  Segment* next;
};

}  // namespace

struct Block {
  Segment* seg;
  std::size_t offset, size, requested;
  std::uint64_t id;
  Block* prev;       // neighbours in the segment, by address
  Block* next;
  Block* free_prev;  // links in the free bucket of its size
  Block* free_next;
  bool free;
  Category category;
  // A planned buffer: a piece of an arena block (see mem::plan_begin), outside every
  // segment's block list; `owner` is the arena block.
  bool view = false;
  Block* owner = nullptr;
};

const char* category_name(Category c) noexcept { return kCategoryNames[int(c)]; }

bool parse_category(const std::string& name, Category* out) noexcept {
  for (int i = 0; i < kNumCategories; ++i) {
    if (name == kCategoryNames[i]) {
      *out = Category(i);
      return true;
    }
  }
  return false;
}

std::string category_list() {
  std::string s = "[";
  for (int i = 0; i < kNumCategories; ++i) {
    s += std::string(i ? ", '" : "'") + kCategoryNames[i] + "'";
  }
  return s + "]";
}

namespace {

// Fresh zeroed pages straight from the kernel, aligned to 2 MiB so whole huge pages can back
// them; nullptr when the system refuses.
char* map_segment(std::size_t size, bool huge) {
#if defined(__linux__)
  const std::size_t span = size + kLargeRound;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const std::uintptr_t start = (std::uintptr_t(raw) + kLargeRound - 1) & ~(kLargeRound - 1);
  const std::size_t head = start - std::uintptr_t(raw);
  if (head) munmap(raw, head);
  if (span - head - size) munmap(reinterpret_cast<char*>(start) + size, span - head - size);
#if defined(MADV_HUGEPAGE)
  if (huge) madvise(reinterpret_cast<void*>(start), size, MADV_HUGEPAGE);  // advisory
#endif
  return reinterpret_cast<char*>(start);
#else
  (void)huge;
  return static_cast<char*>(std::aligned_alloc(kLargeRound, size));
#endif
}

void unmap_segment(char* base, std::size_t size) {
#if defined(__linux__)
  munmap(base, size);
#else
  (void)size;
  std::free(base);
#endif
}

// Free blocks of one size, most recently freed last (handed out first: its bytes are warmest).
struct Bucket {
  Block* first = nullptr;
  Block* last = nullptr;
};

class CachingAllocator {
 public:
  Block* allocate(std::size_t requested, Category cat) {
    std::lock_guard<std::mutex> lock(mu_);
    if (plan_active_ && cat != Category::workspace && std::this_thread::get_id() == plan_thread_) {
      Block* v = plan_next_locked(requested, cat);
      if (v != nullptr) return v;
    }
    return allocate_locked(requested, cat);
  }
  void release(Block* b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (b->view) {
      release_view_locked(b);
      return;
    }
    release_locked(b);
  }
  void plan_begin(std::size_t arena_bytes, std::vector<mem::PlanEntry> entries) {
    std::lock_guard<std::mutex> lock(mu_);
    if (plan_active_) {
      throw std::logic_error("plan_begin: expected no planned run in progress, got one");
    }
    for (const mem::PlanEntry& e : entries) {
      if (e.offset >= 0 && (std::size_t(e.offset) + e.size > arena_bytes || e.size < e.requested)) {
        throw std::invalid_argument("plan_begin: expected every planned buffer inside the arena of " +
                                    std::to_string(arena_bytes) + " bytes, got one at offset " +
                                    std::to_string(e.offset) + " of " + std::to_string(e.size) + " bytes");
      }
    }
    arena_ = allocate_locked(arena_bytes, Category::activation);
    arenas_[arena_] = ArenaState{0, false};
    plan_ = std::move(entries);
    plan_count_ = 0;
    plan_diverged_ = -1;
    plan_reason_.clear();
    cur_views_.clear();
    plan_thread_ = std::this_thread::get_id();
    plan_active_ = true;
  }
  mem::PlanResult plan_end() {
    std::lock_guard<std::mutex> lock(mu_);
    mem::PlanResult r{std::int64_t(plan_count_), plan_diverged_, plan_reason_};
    if (!plan_active_) return r;
    plan_active_ = false;
    if (r.diverged < 0 && plan_count_ < plan_.size()) {
      r.reason = "fewer allocations than traced, expected " + std::to_string(plan_.size()) +
                 ", got " + std::to_string(plan_count_);
    }
    ArenaState& st = arenas_[arena_];
    st.finished = true;
    if (st.live == 0) {
      arenas_.erase(arena_);
      release_locked(arena_);
    }
    arena_ = nullptr;
    plan_.clear();
    for (Block* v : cur_views_) {
      if (v->free) spare_.push_back(v);  // live ones go to spare_ when released
    }
    cur_views_.clear();
    return r;
  }
  void retag(Block* b, Category cat) {
    std::lock_guard<std::mutex> lock(mu_);
    if (b->view) {  // its bytes are the arena's, counted once under the arena's category
      b->category = cat;
      return;
    }
    const Category old = b->category;
    if (b->free || old == cat) return;
    count(old, -std::int64_t(b->size), -std::int64_t(b->requested));
    b->category = cat;
    count(cat, std::int64_t(b->size), std::int64_t(b->requested));
    if (recording_) log(mem::EventKind::retag, b, false, old);
  }
  void* alloc_raw(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    Block* b = allocate_locked(bytes, Category::workspace);
    void* p = b->seg->base + b->offset;
    raw_.emplace(p, b);
    return p;
  }
  void free_raw(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = raw_.find(p);
    if (it == raw_.end()) return;  // not ours: ignoring beats corrupting the free lists
    Block* b = it->second;
    raw_.erase(it);
    release_locked(b);
  }
  mem::Stats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    mem::Stats s = st_;
    s.num_segments = num_segments_;
    return s;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    st_.peak = st_.allocated;
    st_.peak_requested = st_.requested;
    st_.peak_reserved = st_.reserved;
    for (auto& row : st_.by_category) {
      row.peak = row.current;
      row.peak_requested = row.current_requested;
    }
  }
  std::size_t empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    return empty_cache_locked();
  }
  void set_limit(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = bytes;
  }
  std::size_t limit() {
    std::lock_guard<std::mutex> lock(mu_);
    return limit_;
  }
  std::size_t largest_free_block() {
    std::lock_guard<std::mutex> lock(mu_);
    return largest_free_locked();
  }
  std::vector<mem::LiveBlock> live_blocks() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<mem::LiveBlock> out;
    for (Segment* seg = seg_first_; seg; seg = seg->next) {
      for (Block* b = seg->head; b; b = b->next) {
        if (!b->free) {
          out.push_back(mem::LiveBlock{b->id, std::int64_t(b->size), std::int64_t(b->requested),
                                       b->category});
        }
      }
    }
    return out;
  }
  bool set_recording(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    const bool prev = recording_;
    recording_ = on;
    return prev;
  }
  std::vector<mem::Event> events(bool clear) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<mem::Event> out;
    if (clear) out.swap(events_);
    else out = events_;
    return out;
  }
  int intern_op(const std::string& name) {
    std::lock_guard<std::mutex> lock(op_mu_);
    auto it = op_ids_.find(name);
    if (it != op_ids_.end()) return it->second;
    op_names_.push_back(name);
    return op_ids_[name] = int(op_names_.size()) - 1;
  }
  std::string op_name(int op) {
    std::lock_guard<std::mutex> lock(op_mu_);
    return op_names_.at(std::size_t(op));
  }

  void lock_all() {
    op_mu_.lock();
    mu_.lock();
  }
  void unlock_all() {
    mu_.unlock();
    op_mu_.unlock();
  }

 private:
  struct ArenaState {
    std::size_t live;  // views handed out and not yet released
    bool finished;     // plan_end ran: the arena goes back once `live` reaches 0
  };
  void diverge(std::string reason) {
    plan_diverged_ = std::int64_t(plan_count_) - 1;
    plan_reason_ = std::move(reason);
  }
  // The planned block for the next request, or nullptr when it is to be served from the
  // pools: a planned output, or a run that left the trace (then every later request is served
  // from the pools, so a divergent run stays correct, only unplanned).
  Block* plan_next_locked(std::size_t requested, Category cat) {
    const std::size_t k = plan_count_++;
    if (plan_diverged_ >= 0) return nullptr;
    if (k >= plan_.size()) {
      diverge("more allocations than traced, expected " + std::to_string(plan_.size()) +
              ", got allocation #" + std::to_string(k) + " of " + std::to_string(requested) +
              " bytes");
      return nullptr;
    }
    const mem::PlanEntry& e = plan_[k];
    if (e.requested != requested) {
      diverge("allocation #" + std::to_string(k) + " differs from the trace, expected " +
              std::to_string(e.requested) + " bytes, got " + std::to_string(requested));
      return nullptr;
    }
    if (e.offset < 0) return nullptr;
    const std::size_t lo = std::size_t(e.offset), hi = lo + e.size;
    for (std::size_t i = 0; i < cur_views_.size();) {
      Block* v = cur_views_[i];
      if (v->free) {  // released: drop it from the live list
        cur_views_[i] = cur_views_.back();
        cur_views_.pop_back();
        spare_.push_back(v);
        continue;
      }
      const std::size_t vlo = v->offset - arena_->offset, vhi = vlo + v->size;
      if (lo < vhi && vlo < hi) {
        diverge("allocation #" + std::to_string(k) + " would share bytes with a planned buffer "
                "still alive (released later than traced)");
        return nullptr;
      }
      ++i;
    }
    Block* v;
    if (spare_.empty()) {
      v = new Block;
    } else {
      v = spare_.back();
      spare_.pop_back();
    }
    *v = Block{arena_->seg, arena_->offset + lo, e.size, requested, next_id_++, nullptr, nullptr,
               nullptr, nullptr, false, cat, true, arena_};
    ++arenas_[arena_].live;
    cur_views_.push_back(v);
    return v;
  }
  void release_view_locked(Block* v) {
    Block* arena = v->owner;
    v->free = true;
    ArenaState& st = arenas_[arena];
    --st.live;
    const bool current = arena == arena_;
    if (st.finished && st.live == 0) {
      arenas_.erase(arena);
      release_locked(arena);
    }
    // a view of the running plan stays in cur_views_ (recycled at the next overlap scan)
    if (!current) spare_.push_back(v);
  }

  Block* allocate_locked(std::size_t requested, Category cat);
  void release_locked(Block* b);
  Block* new_segment(Pool pool, std::size_t size, std::size_t requested, Category cat);
  std::size_t largest_free_locked() const {
    std::size_t best = 0;
    for (const auto& pool : free_) {
      for (auto it = pool.rbegin(); it != pool.rend(); ++it) {
        if (it->second.first != nullptr) {  // emptied buckets may linger (see allocate)
          if (it->first > best) best = it->first;
          break;
        }
      }
    }
    return best;
  }
  void split(Block* b, std::size_t size, std::size_t rest);
  std::size_t empty_cache_locked();
  Block* new_block(Segment* seg, std::size_t offset, std::size_t size);
  void absorb(Block* first, Block* second);
  void link_free(Block* b);
  void unlink_free(Block* b);
  void count(Category cat, std::int64_t size, std::int64_t requested) {
    mem::CategoryCounters& row = st_.by_category[int(cat)];
    row.current += size;
    if (row.current > row.peak) row.peak = row.current;
    row.current_requested += requested;
    if (row.current_requested > row.peak_requested) row.peak_requested = row.current_requested;
  }
  void log(mem::EventKind kind, const Block* b, bool fresh, Category prev) {
    events_.push_back(mem::Event{kind, b->category, prev, fresh, b->id, std::int64_t(b->size),
                                 std::int64_t(b->requested), st_.allocated, t_op});
  }

  std::mutex mu_;
  std::map<std::size_t, Bucket> free_[2];
  Segment* seg_first_ = nullptr;  // segments in creation order
  Segment* seg_last_ = nullptr;
  std::int64_t num_segments_ = 0;
  std::vector<Block*> spare_;     // Block objects to recycle (splits are frequent)
  std::unordered_map<void*, Block*> raw_;  // needle_alloc pointers -> blocks
  std::uint64_t next_id_ = 1;     // shared by segments and blocks, as in the Python allocator
  mem::Stats st_;
  std::size_t limit_ = 0;  // 0: no limit on reserved bytes
  bool recording_ = false;
  std::vector<mem::Event> events_;

  // the planned run (mem::plan_begin .. plan_end)
  bool plan_active_ = false;
  std::thread::id plan_thread_;  // only this thread's requests follow the plan
  std::vector<mem::PlanEntry> plan_;
  std::size_t plan_count_ = 0;
  std::int64_t plan_diverged_ = -1;
  std::string plan_reason_;
  Block* arena_ = nullptr;
  std::vector<Block*> cur_views_;  // views of arena_ handed out (released ones until scanned)
  std::unordered_map<Block*, ArenaState> arenas_;  // arenas with views alive, by arena block

  std::mutex op_mu_;
  std::unordered_map<std::string, int> op_ids_;
  std::vector<std::string> op_names_;

 public:
  static thread_local int t_op;
};

thread_local int CachingAllocator::t_op = -1;

Block* CachingAllocator::allocate_locked(std::size_t requested, Category cat) {
  // Rounding a request near SIZE_MAX up to a block or segment size would wrap to a tiny one.
  if (requested > kMaxRequest) {
    throw std::length_error("allocate: request too large, expected at most " +
                            std::to_string(kMaxRequest) + " bytes, got " +
                            std::to_string(requested));
  }
  const std::size_t size = requested <= kBlockRound
                               ? kBlockRound
                               : (requested + kBlockRound - 1) / kBlockRound * kBlockRound;
  const bool small = size <= kSmallLimit;
  auto& buckets = free_[small ? kSmall : kLarge];
  auto it = buckets.lower_bound(size);  // best fit: the smallest free size that is big enough
  // Emptied buckets stay in the map (alloc/free of one size then costs no map node) and are
  // dropped here once a search passes them.
  while (it != buckets.end() && it->second.first == nullptr) it = buckets.erase(it);
  Block* b;
  bool fresh = false;
  if (it == buckets.end()) {
    b = new_segment(small ? kSmall : kLarge, size, requested, cat);
    fresh = true;
  } else {
    b = it->second.last;  // LIFO among equals
    it->second.last = b->free_prev;
    (b->free_prev ? b->free_prev->free_next : it->second.first) = nullptr;
    b->free_prev = nullptr;
    ++st_.num_reused;
  }
  const std::size_t rest = b->size - size;
  if (rest && (small || rest > kMinLargeSplit)) split(b, size, rest);
  b->free = false;
  b->requested = requested;
  b->category = cat;
  ++st_.num_allocs;
  st_.allocated += std::int64_t(b->size);
  st_.requested += std::int64_t(requested);
  if (st_.allocated > st_.peak) st_.peak = st_.allocated;
  if (st_.requested > st_.peak_requested) st_.peak_requested = st_.requested;
  count(cat, std::int64_t(b->size), std::int64_t(requested));
  if (recording_) log(mem::EventKind::alloc, b, fresh, cat);
  return b;
}

void CachingAllocator::release_locked(Block* b) {
  b->free = true;
  ++st_.num_frees;
  st_.allocated -= std::int64_t(b->size);
  st_.requested -= std::int64_t(b->requested);
  count(b->category, -std::int64_t(b->size), -std::int64_t(b->requested));
  if (recording_) log(mem::EventKind::free, b, false, b->category);
  b->requested = 0;
  if (b->prev && b->prev->free) {
    Block* prev = b->prev;
    unlink_free(prev);
    absorb(prev, b);
    b = prev;
  }
  if (b->next && b->next->free) {
    Block* next = b->next;
    unlink_free(next);
    absorb(b, next);
  }
  link_free(b);
}

Block* CachingAllocator::new_segment(Pool pool, std::size_t size, std::size_t requested,
                                     Category cat) {
  const std::size_t seg_size =
      pool == kSmall ? kSmallSegment : (size + kLargeRound - 1) / kLargeRound * kLargeRound;
  if (limit_ && std::size_t(st_.reserved) + seg_size > limit_) {
    // Cached segments that are wholly free count against the limit too: return them first,
    // as a device would before failing.
    empty_cache_locked();
    if (std::size_t(st_.reserved) + seg_size > limit_) {
      LimitExceeded err;
      err.requested = requested;
      err.block = size;
      err.segment = seg_size;
      err.allocated = st_.allocated;
      err.reserved = st_.reserved;
      err.limit = std::int64_t(limit_);
      err.largest_free = std::int64_t(largest_free_locked());
      err.category = cat;
      throw err;
    }
  }
  char* base = map_segment(seg_size, pool == kLarge);
  if (base == nullptr && empty_cache_locked() > 0) base = map_segment(seg_size, pool == kLarge);
  if (base == nullptr) throw std::bad_alloc();
  Segment* seg = new Segment{next_id_++, base, seg_size, pool, nullptr, seg_last_, nullptr};
  (seg_last_ ? seg_last_->next : seg_first_) = seg;
  seg_last_ = seg;
  ++num_segments_;
  seg->head = new_block(seg, 0, seg_size);
  st_.reserved += std::int64_t(seg_size);
  if (st_.reserved > st_.peak_reserved) st_.peak_reserved = st_.reserved;
  ++st_.num_segment_allocs;
  return seg->head;
}

Block* CachingAllocator::new_block(Segment* seg, std::size_t offset, std::size_t size) {
  Block* b;
  if (spare_.empty()) {
    b = new Block;
  } else {
    b = spare_.back();
    spare_.pop_back();
  }
  *b = Block{seg, offset, size, 0, next_id_++, nullptr, nullptr, nullptr, nullptr, true,
             Category::other};
  return b;
}

void CachingAllocator::split(Block* b, std::size_t size, std::size_t rest) {
  Block* tail = new_block(b->seg, b->offset + size, rest);
  tail->prev = b;
  tail->next = b->next;
  if (b->next) b->next->prev = tail;
  b->next = tail;
  b->size = size;
  link_free(tail);
}

void CachingAllocator::absorb(Block* first, Block* second) {
  first->size += second->size;
  first->next = second->next;
  if (second->next) second->next->prev = first;
  spare_.push_back(second);
}

void CachingAllocator::link_free(Block* b) {
  Bucket& bucket = free_[b->seg->pool][b->size];
  b->free_next = nullptr;
  b->free_prev = bucket.last;
  (bucket.last ? bucket.last->free_next : bucket.first) = b;
  bucket.last = b;
}

void CachingAllocator::unlink_free(Block* b) {
  Bucket& bucket = free_[b->seg->pool].find(b->size)->second;
  (b->free_prev ? b->free_prev->free_next : bucket.first) = b->free_next;
  (b->free_next ? b->free_next->free_prev : bucket.last) = b->free_prev;
  b->free_prev = b->free_next = nullptr;
}

std::size_t CachingAllocator::empty_cache_locked() {
  std::size_t released = 0;
  for (Segment* seg = seg_first_; seg;) {
    Segment* next = seg->next;
    Block* head = seg->head;
    if (head->free && !head->next) {
      unlink_free(head);
      spare_.push_back(head);
      (seg->prev ? seg->prev->next : seg_first_) = seg->next;
      (seg->next ? seg->next->prev : seg_last_) = seg->prev;
      unmap_segment(seg->base, seg->size);
      st_.reserved -= std::int64_t(seg->size);
      ++st_.num_segment_frees;
      --num_segments_;
      released += seg->size;
      delete seg;
    }
    seg = next;
  }
  return released;
}

CachingAllocator* g_allocator = nullptr;

#if defined(__unix__)
// fork() while another thread holds the lock would leave the child's copy locked forever
// (data-loader or launcher processes): hold it across the fork instead.
void before_fork() { g_allocator->lock_all(); }
void after_fork() { g_allocator->unlock_all(); }
#endif

// Never destroyed: buffers (thread_local kernel scratch, Arrays freed during interpreter
// shutdown) may be released after static destructors would have run.
CachingAllocator& the_allocator() {
  static CachingAllocator* a = [] {
    g_allocator = new CachingAllocator();
#if defined(__unix__)
    pthread_atfork(before_fork, after_fork, after_fork);
#endif
    return g_allocator;
  }();
  return *a;
}

}  // namespace

namespace mem {

Block* allocate(std::size_t requested, Category cat) {
  return the_allocator().allocate(requested, cat);
}
void release(Block* b) noexcept { the_allocator().release(b); }
void retag(Block* b, Category cat) noexcept { the_allocator().retag(b, cat); }
void* data(const Block* b) noexcept { return b->seg->base + b->offset; }
std::uint64_t block_id(const Block* b) noexcept { return b->id; }
std::size_t block_size(const Block* b) noexcept { return b->size; }
Category block_category(const Block* b) noexcept { return b->category; }
Stats stats() { return the_allocator().stats(); }
void reset_peak() { the_allocator().reset_peak(); }
std::size_t empty_cache() { return the_allocator().empty_cache(); }
void set_limit(std::size_t bytes) { the_allocator().set_limit(bytes); }
std::size_t limit() { return the_allocator().limit(); }
std::size_t largest_free_block() { return the_allocator().largest_free_block(); }
std::vector<LiveBlock> live_blocks() { return the_allocator().live_blocks(); }
void plan_begin(std::size_t arena_bytes, std::vector<PlanEntry> entries) {
  the_allocator().plan_begin(arena_bytes, std::move(entries));
}
PlanResult plan_end() { return the_allocator().plan_end(); }
bool set_recording(bool on) { return the_allocator().set_recording(on); }
std::vector<Event> events(bool clear) { return the_allocator().events(clear); }
int intern_op(const std::string& name) { return the_allocator().intern_op(name); }
std::string op_name(int op) { return the_allocator().op_name(op); }
int set_thread_op(int op) noexcept {
  const int prev = CachingAllocator::t_op;
  CachingAllocator::t_op = op;
  return prev;
}

}  // namespace mem

void* needle_alloc(std::size_t bytes) { return the_allocator().alloc_raw(bytes); }

void needle_free(void* ptr) noexcept {
  if (ptr) the_allocator().free_raw(ptr);
}

}  // namespace needle
