// A kernel program run from C++: needle.compile's replay without a Python line per kernel.
// Included by ndarray_backend_cpu.cc only, inside its anonymous namespace, after the entry
// points it calls (binary, add_rows, scalar, unary, matmul_strided, reduce, sum_leading,
// compact, ewise_setitem, fill): each step runs through the same checks and kernels as the
// Python-visible function of the same name.
//
// needle/compiler/native.py builds a _KernelList from a recorded program: slots hold the
// buffers (externals handed in per run, the others made by alloc steps and dropped by free
// steps, so a planned arena serves them as it serves the eager step), scalar registers hold
// the floats that replayed() bookkeeping returns (needle/compiler/effects.py). Kernels without
// a native step (fused ops, random fills, conv, ...) are `python` steps: their pybind function
// called with the slots' Array objects, without the Python interpreter in between.
#pragma once
// No includes here: this file is pasted inside needle's anonymous namespace; the includer
// brings pybind11, <chrono>, <memory>, <string>, <vector>, array.h, kernels.h and
// ewise_program.h.

class KernelList {
 public:
  enum Kind { kAlloc, kFree, kBinary, kScalar, kUnary, kMatmulStrided, kReduce, kCompact, kFill,
              kProgram, kPython, kAddRows, kSetitem, kSumLeading };

  explicit KernelList(int n_slots, int n_scalars) : n_slots_(n_slots), n_scalars_(n_scalars) {
    if (n_slots < 0 || n_scalars < 0) throw std::invalid_argument("_KernelList: bad sizes");
  }

  // ---- building (needle/compiler/native.py) --------------------------------------------
  void add_alloc(int slot, std::int64_t size, const py::object& dtype, const py::object& category) {
    Step s(kAlloc);
    s.slots = {check_slot(slot)};
    s.ints = {size};
    s.dtype = dtype_of(dtype);
    s.category = pyalloc::to_category(category, "_KernelList.alloc");
    steps_.push_back(std::move(s));
  }
  void add_free(int slot) { add(kFree, 0, {slot}, {}); }
  void add_binary(int op, int a, int b, int out) { add(kBinary, op, {a, b, out}, {}); }
  void add_add_rows(int a, int row, int out, std::int64_t m, std::int64_t n) {
    add(kAddRows, 0, {a, row, out}, {m, n});
  }
  void add_scalar(int op, bool reversed, int a, double val, int reg, int out) {
    Step& s = add(kScalar, op, {a, out}, {});
    s.reversed = reversed;
    s.value = val;
    s.reg = check_reg(reg, true);
  }
  void add_unary(int op, int a, int out) { add(kUnary, op, {a, out}, {}); }
  void add_matmul_strided(int a, int b, int out, const std::vector<std::int64_t>& dims) {
    if (dims.size() != 9) throw std::invalid_argument("_KernelList.matmul_strided: 9 ints");
    add(kMatmulStrided, 0, {a, b, out}, dims);
  }
  void add_reduce(int op, int a, int out, std::int64_t size) { add(kReduce, op, {a, out}, {size}); }
  void add_sum_leading(int a, int out, std::int64_t m, std::int64_t n) {
    add(kSumLeading, 0, {a, out}, {m, n});
  }
  // compact (a strided view of `a` gathered into `out`) or, with `scatter`, ewise_setitem
  // (compact `a` written into a strided view of `out`)
  void add_compact(int a, int out, const Dims& shape, const Dims& strides, std::int64_t offset,
                   bool scatter) {
    if (shape.size() != strides.size()) {
      throw std::invalid_argument("_KernelList.compact: shape and strides differ in length");
    }
    Step& s = add(scatter ? kSetitem : kCompact, 0, {a, out}, {offset});
    s.shape = shape;
    s.strides = strides;
  }
  void add_fill(int out, double val) { add(kFill, 0, {out}, {}).value = val; }
  // ewise_program over slots `ins` -> `outs` (the program is checked once, here)
  void add_program(const std::vector<int>& ins, const std::vector<int>& outs,
                   const std::vector<std::int32_t>& code, const std::vector<double>& scalars,
                   std::int64_t n) {
    check_ewise_program(code, ins.size(), outs.size(), scalars.size());
    Step& s = add(kProgram, 0, ins, {n});
    for (int slot : outs) s.out_slots.push_back(check_slot(slot));
    s.code = code;
    s.scalars = scalars;
  }
  // fn(*args) with args[i] = slot's Array where slot_at[i] >= 0, the float in scalar register
  // reg_at[i] where that is >= 0, a list of the Arrays of lists[i] where that is not empty,
  // else args[i] as given; its result (a float or a tuple of floats) goes to the registers
  // from `result_reg` on (-1: dropped).
  void add_python(py::object fn, py::list args, const std::vector<int>& slot_at,
                  const std::vector<int>& reg_at, const std::vector<std::vector<int>>& lists,
                  int result_reg) {
    if (slot_at.size() != args.size() || reg_at.size() != args.size() ||
        lists.size() != args.size()) {
      throw std::invalid_argument("_KernelList.python: one slot, register and list per argument");
    }
    Step s(kPython);
    for (std::size_t i = 0; i < slot_at.size(); ++i) {
      if (slot_at[i] >= 0) check_slot(slot_at[i]);
      if (reg_at[i] >= 0) check_reg(reg_at[i], false);
      for (int slot : lists[i]) check_slot(slot);
    }
    s.lists = lists;
    s.fn = std::move(fn);
    for (py::handle arg : args) s.args.push_back(py::reinterpret_borrow<py::object>(arg));
    s.slot_at = slot_at;
    s.reg_at = reg_at;
    s.reg = result_reg < 0 ? -1 : check_reg(result_reg, false);
    steps_.push_back(std::move(s));
  }

  // ---- running --------------------------------------------------------------------------
  // handles: the Arrays of the external slots, in order; the list is emptied, so that the
  // program holds the only references it took and frees each buffer after its last use.
  // Returns the Arrays of `outputs` (slots it made).
  py::tuple run(py::list handles, const std::vector<int>& externals,
                const std::vector<int>& outputs) {
    if (handles.size() != externals.size()) {
      throw std::invalid_argument("_KernelList.run: expected " +
                                  std::to_string(externals.size()) + " buffers, got " +
                                  std::to_string(handles.size()));
    }
    Slots slots(static_cast<std::size_t>(n_slots_));
    std::vector<double> regs(static_cast<std::size_t>(n_scalars_), 0.0);
    for (std::size_t i = 0; i < externals.size(); ++i) {
      const int slot = check_slot(externals[i]);
      slots.held[std::size_t(slot)] = handles[i];
      slots.buf[std::size_t(slot)] = pyarray::array_or_null(handles[i], "_KernelList.run");
    }
    handles.attr("clear")();
    if (profile_) {
      times_ns_.assign(steps_.size(), 0);
      for (std::size_t i = 0; i < steps_.size(); ++i) {
        const auto start = std::chrono::steady_clock::now();
        run_step(steps_[i], slots, regs);
        times_ns_[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - start).count();
      }
    } else {
      for (const Step& s : steps_) run_step(s, slots, regs);
    }
    py::tuple out(outputs.size());
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const int slot = check_slot(outputs[i]);
      if (!slots.buf[std::size_t(slot)]) {
        throw std::logic_error("_KernelList.run: output slot " + std::to_string(slot) +
                               " holds no buffer at the end");
      }
      out[i] = slots.object(slot);
    }
    return out;
  }

  std::size_t size() const { return steps_.size(); }

  // Profiling (bench/profile_compiled.py): while on, each run times every step; timings()
  // gives (label, nanoseconds) per step of the last profiled run.
  void set_profile(bool on) { profile_ = on; }
  py::list timings() const {
    py::list out;
    for (std::size_t i = 0; i < times_ns_.size() && i < steps_.size(); ++i) {
      out.append(py::make_tuple(label(steps_[i]), times_ns_[i]));
    }
    return out;
  }

 private:
  struct Step {
    explicit Step(Kind k) : kind(k) {}
    Kind kind;
    int op = 0;
    bool reversed = false;
    int reg = -1;
    double value = 0.0;
    DType dtype = DType::f32;
    Category category = Category::other;
    std::vector<int> slots;
    std::vector<std::int64_t> ints;
    Dims shape, strides;
    py::object fn;
    std::vector<py::object> args;
    std::vector<int> slot_at, reg_at;
    std::vector<std::vector<int>> lists;
    std::vector<int> out_slots;
    std::vector<std::int32_t> code;
    std::vector<double> scalars;
  };

  // A slot's buffer: owned here (made by an alloc step and never shown to Python) or, once
  // Python needs it (an argument of a python step, an output, an external), a Python object.
  struct Slots {
    explicit Slots(std::size_t n) : held(n), owned(n), buf(n, nullptr) {}
    std::vector<py::object> held;
    std::vector<std::unique_ptr<Array>> owned;
    std::vector<Array*> buf;
    const py::object& object(int slot) {
      const std::size_t i = std::size_t(slot);
      if (!held[i] && owned[i]) {
        held[i] = py::cast(owned[i].release(), py::return_value_policy::take_ownership);
      }
      return held[i];
    }
  };

  int check_slot(int slot) const {
    if (slot < 0 || slot >= n_slots_) {
      throw std::invalid_argument("_KernelList: slot " + std::to_string(slot) +
                                  " outside [0, " + std::to_string(n_slots_) + ")");
    }
    return slot;
  }
  int check_reg(int reg, bool optional) const {
    if ((reg < 0 && optional) || (reg >= 0 && reg < n_scalars_)) return reg;
    throw std::invalid_argument("_KernelList: scalar register " + std::to_string(reg) +
                                " outside [0, " + std::to_string(n_scalars_) + ")");
  }
  Step& add(Kind kind, int op, std::vector<int> slots, std::vector<std::int64_t> ints) {
    for (int slot : slots) check_slot(slot);
    if ((kind == kBinary || kind == kScalar) &&
        (op < 0 || op > int(BinOp::relu_grad))) {
      throw std::invalid_argument("_KernelList: unknown binary op " + std::to_string(op));
    }
    if (kind == kUnary && (op < 0 || op > int(UnOp::sigmoid))) {
      throw std::invalid_argument("_KernelList: unknown unary op " + std::to_string(op));
    }
    if (kind == kReduce && (op < 0 || op > int(RedOp::min))) {
      throw std::invalid_argument("_KernelList: unknown reduction " + std::to_string(op));
    }
    Step s(kind);
    s.op = op;
    s.slots = std::move(slots);
    s.ints = std::move(ints);
    steps_.push_back(std::move(s));
    return steps_.back();
  }

  static Array& at(Slots& slots, int slot) {
    Array* a = slots.buf[std::size_t(slot)];
    if (!a) {
      throw std::logic_error("_KernelList.run: slot " + std::to_string(slot) +
                             " read while it holds no buffer");
    }
    return *a;
  }

  static void run_step(const Step& s, Slots& slots, std::vector<double>& regs) {
    const auto& v = s.slots;
    switch (s.kind) {
      case kAlloc: {
        const std::size_t i = std::size_t(v[0]);
        slots.owned[i] = std::make_unique<Array>(s.ints[0], s.dtype, s.category);
        slots.held[i] = py::object();
        slots.buf[i] = slots.owned[i].get();
        return;
      }
      case kFree: {
        const std::size_t i = std::size_t(v[0]);
        slots.buf[i] = nullptr;
        slots.owned[i].reset();
        slots.held[i] = py::object();
        return;
      }
      case kBinary:
        return needle::binary(BinOp(s.op), "ewise", at(slots, v[0]), at(slots, v[1]),
                              at(slots, v[2]));
      case kScalar:
        return needle::scalar(BinOp(s.op), s.reversed, "scalar", at(slots, v[0]),
                              s.reg >= 0 ? regs[std::size_t(s.reg)] : s.value, at(slots, v[1]));
      case kUnary:
        return needle::unary(UnOp(s.op), "ewise", at(slots, v[0]), at(slots, v[1]));
      case kMatmulStrided: {
        const auto& d = s.ints;
        return needle::matmul_strided(at(slots, v[0]), at(slots, v[1]), at(slots, v[2]), d[0],
                                      d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8]);
      }
      case kReduce:
        return needle::reduce(RedOp(s.op), "reduce", at(slots, v[0]), at(slots, v[1]),
                              s.ints[0]);
      case kCompact:
        return needle::compact(at(slots, v[0]), at(slots, v[1]), s.shape, s.strides, s.ints[0]);
      case kSetitem:
        return needle::ewise_setitem(at(slots, v[0]), at(slots, v[1]), s.shape, s.strides,
                                     s.ints[0]);
      case kFill:
        return needle::fill(at(slots, v[0]), s.value);
      case kSumLeading:
        return needle::sum_leading(at(slots, v[0]), at(slots, v[1]), s.ints[0], s.ints[1]);
      case kAddRows:
        return needle::add_rows(at(slots, v[0]), at(slots, v[1]), at(slots, v[2]), s.ints[0],
                                s.ints[1]);
      case kProgram: {
        std::vector<const Array*> ins;
        std::vector<Array*> outs;
        for (int slot : v) ins.push_back(&at(slots, slot));
        for (int slot : s.out_slots) outs.push_back(&at(slots, slot));
        return run_ewise_program(*g_kernels, ins, outs, s.code, s.scalars, s.ints[0], true);
      }
      case kPython: {
        py::tuple args(s.args.size());
        for (std::size_t i = 0; i < s.args.size(); ++i) {
          if (s.slot_at[i] >= 0) {
            at(slots, s.slot_at[i]);  // a live buffer, not a stale slot
            args[i] = slots.object(s.slot_at[i]);
          } else if (s.reg_at[i] >= 0) {
            args[i] = py::float_(regs[std::size_t(s.reg_at[i])]);
          } else if (!s.lists[i].empty()) {
            py::list items(s.lists[i].size());
            for (std::size_t j = 0; j < s.lists[i].size(); ++j) {
              at(slots, s.lists[i][j]);
              items[j] = slots.object(s.lists[i][j]);
            }
            args[i] = std::move(items);
          } else {
            args[i] = s.args[i];
          }
        }
        py::object result = s.fn(*args);
        if (s.reg >= 0) {
          if (py::isinstance<py::tuple>(result)) {
            py::tuple values = result;
            for (std::size_t j = 0; j < values.size(); ++j) {
              regs.at(std::size_t(s.reg) + j) = values[j].cast<double>();
            }
          } else {
            regs.at(std::size_t(s.reg)) = result.cast<double>();
          }
        }
        return;
      }
    }
  }

  static std::string label(const Step& s) {
    static const char* const kinds[] = {"alloc", "free", "binary", "scalar", "unary",
                                        "matmul_strided", "reduce", "compact", "fill",
                                        "program", "python", "add_rows", "setitem",
                                        "sum_leading"};
    std::string out = kinds[s.kind];
    if (s.kind == kBinary || s.kind == kScalar || s.kind == kUnary || s.kind == kReduce) {
      out += ":" + std::to_string(s.op);
    } else if (s.kind == kPython) {
      py::object name = py::getattr(s.fn, "__name__", py::str("?"));
      out += ":" + py::str(name).cast<std::string>();
    } else if (s.kind == kMatmulStrided) {
      // m x n times n x p, with each operand's (row, column) strides
      const auto& d = s.ints;
      out += ":" + std::to_string(d[0]) + "x" + std::to_string(d[1]) + "x" +
             std::to_string(d[2]) + " a(" + std::to_string(d[4]) + "," + std::to_string(d[5]) +
             ") b(" + std::to_string(d[7]) + "," + std::to_string(d[8]) + ")";
    }
    return out;
  }

  int n_slots_, n_scalars_;
  std::vector<Step> steps_;
  bool profile_ = false;
  std::vector<std::int64_t> times_ns_;
};

inline void bind_kernel_list(py::module_& m) {
  py::class_<KernelList>(m, "_KernelList",
                         "A recorded kernel program run from C++ (needle/compiler/native.py).")
      .def(py::init<int, int>(), py::arg("n_slots"), py::arg("n_scalars"))
      .def("alloc", &KernelList::add_alloc)
      .def("free", &KernelList::add_free)
      .def("binary", &KernelList::add_binary)
      .def("add_rows", &KernelList::add_add_rows)
      .def("sum_leading", &KernelList::add_sum_leading)
      .def("scalar", &KernelList::add_scalar)
      .def("unary", &KernelList::add_unary)
      .def("matmul_strided", &KernelList::add_matmul_strided)
      .def("reduce", &KernelList::add_reduce)
      .def("compact", &KernelList::add_compact, py::arg("a"), py::arg("out"), py::arg("shape"),
           py::arg("strides"), py::arg("offset"), py::arg("scatter") = false)
      .def("fill", &KernelList::add_fill)
      .def("program", &KernelList::add_program)
      .def("python", &KernelList::add_python)
      .def("run", &KernelList::run)
      .def("set_profile", &KernelList::set_profile)
      .def("timings", &KernelList::timings)
      .def("__len__", &KernelList::size);
}
