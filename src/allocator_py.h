// Python bindings of the caching allocator: statistics, categories, the event log.
// Included by ndarray_backend_cpu.cc only (the module's one translation unit with pybind11).
//
// Category of a new Array, resolved with the GIL held when it is created:
//   1. this thread's category set by allocator_set_category(name), if any;
//   2. else, when allocator_set_category_state(state) installed needle.memory's thread-local
//      category state, the resolution of needle.memory.categories.resolve read from its
//      fields (user_top, hint, framework_top, op_category) without calling Python;
//   3. else the resolver installed by allocator_set_category_resolver(fn): fn(hint);
//   4. else the `category=` hint given to Array(...);
//   5. else "other".
// Kernel workspaces (needle_alloc, no GIL) are always "workspace".
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "allocator.h"
#include "array.h"

namespace needle {
namespace pyalloc {

namespace py = pybind11;

inline thread_local int t_category = -1;  // -1: not set on this thread
inline py::object* g_resolver = nullptr;  // guarded by the GIL; leaked on purpose (shutdown)
inline PyObject* g_category_state = nullptr;  // a threading.local; GIL-guarded, owned
inline py::object* g_oom_handler = nullptr;  // fn(info) -> exception to raise; same rules

// A LimitExceeded reaching Python: the handler (needle.memory's out-of-memory report) turns
// the numbers into an OutOfMemoryError that names what is live; without one, a MemoryError.
inline void raise_limit_exceeded(const LimitExceeded& e) {
  py::dict info;
  info["device"] = "cpu";
  info["requested"] = e.requested;
  info["block"] = e.block;
  info["segment"] = e.segment;
  info["allocated"] = e.allocated;
  info["reserved"] = e.reserved;
  info["limit"] = e.limit;
  info["largest_free_block"] = e.largest_free;
  info["category"] = category_name(e.category);
  if (g_oom_handler != nullptr && !g_oom_handler->is_none()) {
    try {
      py::object exc = (*g_oom_handler)(info);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      return;
    } catch (py::error_already_set& err) {
      err.restore();
      return;
    }
  }
  const std::string msg = "cpu allocator: limit of " + std::to_string(e.limit) +
                          " bytes exceeded by a request of " + std::to_string(e.requested) +
                          " bytes";
  PyErr_SetString(PyExc_MemoryError, msg.c_str());
}

// needle._core.errors.MemoryArgumentError (a NeedleError and ValueError) when importable.
[[noreturn]] inline void raise_category_error(const char* op, py::handle got) {
  static py::handle cls = [] {
    try {
      return py::object(py::module_::import("needle._core.errors").attr("MemoryArgumentError"))
          .release();
    } catch (py::error_already_set&) {
      return py::handle(PyExc_ValueError);
    }
  }();
  const std::string msg = std::string(op) + ": unknown memory category, expected one of " +
                          category_list() + ", got " + std::string(py::repr(got));
  PyErr_SetString(cls.ptr(), msg.c_str());
  throw py::error_already_set();
}

inline Category to_category(py::handle name, const char* op) {
  Category c;
  if (!py::isinstance<py::str>(name) || !parse_category(name.cast<std::string>(), &c)) {
    raise_category_error(op, name);
  }
  return c;
}

// The category named by `name`; interned names (every literal in needle) are matched by
// pointer, anything else by value.
inline Category category_of_name(PyObject* name, const char* op) {
  static PyObject* interned[kNumCategories] = {};
  if (interned[0] == nullptr) {
    for (int i = 0; i < kNumCategories; ++i) {
      interned[i] = PyUnicode_InternFromString(category_name(Category(i)));  // leaked
    }
  }
  for (int i = 0; i < kNumCategories; ++i) {
    if (name == interned[i]) return Category(i);
  }
  return to_category(name, op);
}

// One field of the thread-local state: a category name, or -1 for None. `fields` is this
// thread's attribute dict of the state (read once per allocation: each attribute read of a
// threading.local looks the thread's dict up again); a field missing there is read from the
// state object itself (its class default).
inline int state_field(PyObject* fields, PyObject* field) {
  PyObject* value = fields != nullptr ? PyDict_GetItemWithError(fields, field) : nullptr;
  if (value == nullptr) {
    if (PyErr_Occurred() != nullptr) throw py::error_already_set();
    value = PyObject_GetAttr(g_category_state, field);
    if (value == nullptr) throw py::error_already_set();
    const int out = value == Py_None ? -1 : int(category_of_name(value, "category state"));
    Py_DECREF(value);
    return out;
  }
  return value == Py_None ? -1 : int(category_of_name(value, "category state"));
}

// needle.memory.categories.resolve, read from the state's fields: innermost user scope >
// hint > innermost framework scope > the op default > "other".
inline Category resolve_from_state(const py::object& hint) {
  static PyObject* const dict = PyUnicode_InternFromString("__dict__");
  static PyObject* const user = PyUnicode_InternFromString("user_top");
  static PyObject* const framework = PyUnicode_InternFromString("framework_top");
  static PyObject* const op = PyUnicode_InternFromString("op_category");
  py::object fields =
      py::reinterpret_steal<py::object>(PyObject_GetAttr(g_category_state, dict));
  if (!fields) PyErr_Clear();  // no attribute dict: every field comes from getattr
  PyObject* d = fields && PyDict_Check(fields.ptr()) ? fields.ptr() : nullptr;
  int c = state_field(d, user);
  if (c >= 0) return Category(c);
  if (!hint.is_none()) return category_of_name(hint.ptr(), "Array");
  c = state_field(d, framework);
  if (c >= 0) return Category(c);
  c = state_field(d, op);
  return c >= 0 ? Category(c) : Category::other;
}

inline Category creation_category(const py::object& hint) {
  if (!hint.is_none()) category_of_name(hint.ptr(), "Array");  // a bad hint is an error
  if (t_category >= 0) return Category(t_category);
  if (g_category_state != nullptr) return resolve_from_state(hint);
  if (g_resolver != nullptr && !g_resolver->is_none()) {
    return to_category((*g_resolver)(hint), "allocator resolver");
  }
  return hint.is_none() ? Category::other : to_category(hint, "Array");
}

inline py::dict stats_dict() {
  const mem::Stats s = mem::stats();
  py::dict by_category;
  for (int i = 0; i < kNumCategories; ++i) {
    const mem::CategoryCounters& r = s.by_category[i];
    py::dict row;
    row["current"] = r.current;
    row["peak"] = r.peak;
    row["current_requested"] = r.current_requested;
    row["peak_requested"] = r.peak_requested;
    by_category[category_name(Category(i))] = row;
  }
  py::dict d;
  d["device"] = "cpu";
  d["allocated_bytes"] = s.allocated;
  d["requested_bytes"] = s.requested;
  d["peak_bytes"] = s.peak;
  d["peak_requested_bytes"] = s.peak_requested;
  d["reserved_bytes"] = s.reserved;
  d["peak_reserved_bytes"] = s.peak_reserved;
  d["cached_bytes"] = s.reserved - s.allocated;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["num_reused"] = s.num_reused;
  d["num_segments"] = s.num_segments;
  d["num_segment_allocs"] = s.num_segment_allocs;
  d["num_segment_frees"] = s.num_segment_frees;
  d["by_category"] = by_category;
  return d;
}

// Tuples in the field order of needle.memory.timeline.Event, so `Event(*t)` rebuilds one.
inline py::list events_list(bool clear) {
  static const char* const kinds[] = {"alloc", "free", "retag"};
  py::list out;
  std::vector<std::string> names;  // op names resolved once per distinct index
  for (const mem::Event& e : mem::events(clear)) {
    py::object op = py::none();
    if (e.op >= 0) {
      if (std::size_t(e.op) >= names.size()) names.resize(std::size_t(e.op) + 1);
      if (names[std::size_t(e.op)].empty()) names[std::size_t(e.op)] = mem::op_name(e.op);
      op = py::str(names[std::size_t(e.op)]);
    }
    py::object prev = e.kind == mem::EventKind::retag
                          ? py::object(py::str(category_name(e.prev_category)))
                          : py::object(py::none());
    out.append(py::make_tuple(kinds[int(e.kind)], "cpu", e.nbytes, e.requested,
                              category_name(e.category), op, e.block, e.new_segment,
                              e.allocated, prev));
  }
  return out;
}

// ns per allocate+release pair of `nbytes`, measured in C++ (no Python in the loop).
inline double bench(std::size_t nbytes, std::int64_t iterations) {
  py::gil_scoped_release release;
  mem::release(mem::allocate(nbytes, Category::workspace));  // warm: a cached block exists
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < iterations; ++i) {
    mem::release(mem::allocate(nbytes, Category::workspace));
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(iterations);
}

// `threads` C++ threads allocate, retag and free random sizes (small and large pools, Array
// blocks and raw workspaces) concurrently; everything is freed before returning.
inline void stress(int threads, std::int64_t iterations, std::uint64_t seed) {
  py::gil_scoped_release release;
  auto work = [iterations](std::uint64_t s) {
    std::mt19937_64 rng(s);
    std::vector<Block*> live;
    std::vector<void*> raw;
    for (std::int64_t i = 0; i < iterations; ++i) {
      const std::uint64_t r = rng();
      const std::size_t bytes = r % 8 == 0 ? std::size_t(rng() % (3u << 20))
                                           : std::size_t(rng() % 70000);
      switch ((r >> 8) % 5) {
        case 0: case 1:
          if (live.size() < 16) {
            live.push_back(mem::allocate(bytes, Category(rng() % kNumCategories)));
            break;
          }
          [[fallthrough]];  // bounded: free one instead
        case 2:
          if (!live.empty()) {
            const std::size_t k = rng() % live.size();
            mem::release(live[k]);
            live[k] = live.back();
            live.pop_back();
          }
          break;
        case 3:
          if (!live.empty()) {
            mem::retag(live[rng() % live.size()], Category(rng() % kNumCategories));
          }
          break;
        default:
          if (raw.size() < 4) raw.push_back(needle_alloc(bytes));
          else { needle_free(raw.back()); raw.pop_back(); }
      }
    }
    for (Block* b : live) mem::release(b);
    for (void* p : raw) needle_free(p);
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, seed + std::uint64_t(t));
  for (auto& th : pool) th.join();
}

// The Array type's category and block_id properties live with the type (array_py.h).
inline void bind(py::module_& m) {
  m.def("allocator_stats", &stats_dict, "Statistics of the caching allocator (docs/memory.md).");
  m.def("allocator_reset_peak", &mem::reset_peak, "Set every peak to its current value.");
  m.def("allocator_empty_cache", [] {
    py::gil_scoped_release release;
    return mem::empty_cache();
  }, "Unmap wholly free segments; returns the bytes released.");
  m.def("allocator_retag", [](Array& a, py::handle name) {
    mem::retag(a.block(), to_category(name, "allocator_retag"));
  }, py::arg("array"), py::arg("category"));
  m.def("allocator_set_category_resolver", [](py::object fn) {
    py::object prev = g_resolver ? *g_resolver : py::none();
    if (g_resolver == nullptr) g_resolver = new py::object();
    *g_resolver = std::move(fn);
    return prev;
  }, py::arg("fn"), "Install fn(hint) -> category name (None uninstalls); returns the previous.");
  m.def("allocator_set_category_state", [](py::object state) {
    py::object prev = g_category_state ? py::reinterpret_steal<py::object>(g_category_state)
                                       : py::object(py::none());
    g_category_state = state.is_none() ? nullptr : state.release().ptr();
    return prev;
  }, py::arg("state"),
        "Resolve categories from needle.memory's thread-local state object (fields user_top, "
        "framework_top, op_category: a category name or None) instead of calling a resolver; "
        "None uninstalls. Returns the previous state object.");
  m.def("allocator_set_category", [](py::object name) -> py::object {
    const int prev = t_category;
    t_category = name.is_none() ? -1 : int(to_category(name, "allocator_set_category"));
    return prev < 0 ? py::object(py::none()) : py::object(py::str(category_name(Category(prev))));
  }, py::arg("name"), "This thread's category for new Arrays (None: unset); returns the previous.");
  m.def("allocator_plan_begin", [](std::size_t arena_bytes, const std::vector<std::tuple<std::size_t, std::int64_t, std::size_t>>& entries) {
    std::vector<mem::PlanEntry> plan;
    plan.reserve(entries.size());
    for (const auto& [requested, offset, size] : entries) plan.push_back(mem::PlanEntry{requested, offset, size});
    mem::plan_begin(arena_bytes, std::move(plan));
  }, py::arg("arena_bytes"), py::arg("entries"),
        "Serve the next requests from (requested, offset, size) entries: offset -1 from the pools.");
  // A plan's entries converted once: a compiled step begins the same plan every call, and
  // converting ~100 Python tuples costs more than a small step's kernels.
  struct PreparedPlan {
    std::size_t arena_bytes;
    std::vector<mem::PlanEntry> entries;
  };
  py::class_<PreparedPlan>(m, "_PreparedPlan")
      .def_property_readonly("arena_bytes", [](const PreparedPlan& p) { return p.arena_bytes; })
      .def("__len__", [](const PreparedPlan& p) { return p.entries.size(); });
  m.def("allocator_plan_prepare", [](std::size_t arena_bytes, const std::vector<std::tuple<std::size_t, std::int64_t, std::size_t>>& entries) {
    auto* prepared = new PreparedPlan{arena_bytes, {}};
    prepared->entries.reserve(entries.size());
    for (const auto& [requested, offset, size] : entries) {
      prepared->entries.push_back(mem::PlanEntry{requested, offset, size});
    }
    return prepared;
  }, py::arg("arena_bytes"), py::arg("entries"), py::return_value_policy::take_ownership,
        "allocator_plan_begin's arguments converted once, for allocator_plan_begin_prepared.");
  m.def("allocator_plan_begin_prepared", [](const PreparedPlan& prepared) {
    mem::plan_begin(prepared.arena_bytes, prepared.entries);
  }, py::arg("prepared"), "allocator_plan_begin with the arguments of allocator_plan_prepare.");
  m.def("allocator_plan_end", [] {
    const mem::PlanResult r = mem::plan_end();
    return py::make_tuple(r.count, r.diverged, r.reason);
  }, "End the planned run: (requests seen, first divergent request or -1, reason or '').");
  m.def("allocator_record", &mem::set_recording, py::arg("on"),
        "Switch the event log on or off; returns the previous state.");
  m.def("allocator_events", &events_list, py::arg("clear") = true,
        "Logged events as tuples in needle.memory.timeline.Event field order.");
  m.def("allocator_set_op", [](py::object name) -> py::object {
    const int op = name.is_none() ? -1 : mem::intern_op(name.cast<std::string>());
    const int prev = mem::set_thread_op(op);
    return prev < 0 ? py::object(py::none()) : py::object(py::str(mem::op_name(prev)));
  }, py::arg("name"), "This thread's op name for events (None: none); returns the previous.");
  m.def("allocator_set_limit", [](py::object bytes) {
    const std::size_t prev = mem::limit();
    mem::set_limit(bytes.is_none() ? 0 : bytes.cast<std::size_t>());
    return prev ? py::object(py::int_(prev)) : py::object(py::none());
  }, py::arg("bytes"), "Refuse new segments past `bytes` reserved (None: no limit); "
     "returns the previous limit.");
  m.def("allocator_limit", [] {
    const std::size_t lim = mem::limit();
    return lim ? py::object(py::int_(lim)) : py::object(py::none());
  }, "The reserved-bytes limit, or None.");
  m.def("allocator_largest_free_block", &mem::largest_free_block,
        "Bytes of the largest cached free block.");
  m.def("allocator_live_blocks", [] {
    py::list out;
    for (const mem::LiveBlock& b : mem::live_blocks()) {
      out.append(py::make_tuple(b.id, b.size, b.requested, category_name(b.category)));
    }
    return out;
  }, "Blocks in use as (block id, size, requested, category) tuples.");
  m.def("allocator_set_oom_handler", [](py::object fn) {
    py::object prev = g_oom_handler ? *g_oom_handler : py::none();
    if (g_oom_handler == nullptr) g_oom_handler = new py::object();
    *g_oom_handler = std::move(fn);
    return prev;
  }, py::arg("fn"), "Install fn(info: dict) -> exception raised when the limit is exceeded.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const LimitExceeded& e) {
      raise_limit_exceeded(e);
    }
  });
  m.def("_allocator_bench", &bench, py::arg("nbytes"), py::arg("iterations"));
  m.def("_allocator_stress", &stress, py::arg("threads"), py::arg("iterations"),
        py::arg("seed") = 0);
}

}  // namespace pyalloc
}  // namespace needle
