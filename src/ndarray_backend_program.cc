// Entry point of ewise_program, the fused elementwise kernel of needle.compile's kernel
// programs (see ewise_program_impl.h for the instruction format). Everything a bad program
// could crash on is checked here, once per call: dtypes, sizes, register and operand indices,
// op codes, and that an output sharing an input's buffer is written only after the program's
// last read of that input (else a block would read what it already wrote).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "array.h"
#include "array_py.h"
#include "fast_call_args.h"
#include "ewise_program.h"
#include "kernels.h"

namespace py = pybind11;

namespace needle {
namespace {

constexpr int kBinOps = int(BinOp::relu_grad) + 1;
constexpr int kUnOps = int(UnOp::sigmoid) + 1;

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("ewise_program: " + what);
}

}  // namespace

void check_ewise_program(const std::vector<std::int32_t>& code, std::size_t n_in,
                         std::size_t n_out, std::size_t n_scalars) {
  if (code.size() % 5) bad("expected instructions of 5 ints, got " + std::to_string(code.size()));
  std::vector<bool> set(kProgramRegisters, false);
  std::vector<bool> stored(n_out, false);
  auto reg = [&](std::int32_t r, bool read) {
    if (r < 0 || r >= kProgramRegisters) {
      bad("register " + std::to_string(r) + " outside [0, " +
          std::to_string(kProgramRegisters) + ")");
    }
    if (read && !set[std::size_t(r)]) bad("register " + std::to_string(r) + " read before set");
  };
  for (std::size_t k = 0; k < code.size(); k += 5) {
    const std::int32_t kind = code[k], op = code[k + 1], dst = code[k + 2], a = code[k + 3],
                       b = code[k + 4];
    switch (kind) {
      case kLoad:
        if (a < 0 || std::size_t(a) >= n_in) bad("input " + std::to_string(a) + " out of range");
        reg(dst, false);
        break;
      case kStore:
        if (dst < 0 || std::size_t(dst) >= n_out) {
          bad("output " + std::to_string(dst) + " out of range");
        }
        // One store per output: a computation may write its result straight into the output
        // it is stored to (ewise_program_impl.h), so a second store there would change what
        // a later read of the first register sees.
        if (stored[std::size_t(dst)]) bad("output " + std::to_string(dst) + " stored twice");
        stored[std::size_t(dst)] = true;
        reg(a, true);
        continue;
      case kBinary:
        if (op < 0 || op >= kBinOps) bad("unknown binary op " + std::to_string(op));
        reg(a, true), reg(b, true), reg(dst, false);
        break;
      case kScalar:
      case kRScalar:
        if (op < 0 || op >= kBinOps) bad("unknown binary op " + std::to_string(op));
        if (b < 0 || std::size_t(b) >= n_scalars) {
          bad("scalar " + std::to_string(b) + " out of range");
        }
        reg(a, true), reg(dst, false);
        break;
      case kUnary:
        if (op < 0 || op >= kUnOps) bad("unknown unary op " + std::to_string(op));
        reg(a, true), reg(dst, false);
        break;
      default:
        bad("unknown instruction kind " + std::to_string(kind));
    }
    set[std::size_t(dst)] = true;
  }
}

void check_in_place(const std::vector<std::int32_t>& code, std::size_t in, std::size_t out) {
  // Registers are views of the input (kLoad does not copy) until overwritten: after the
  // store to `out`, a read of a register still viewing input `in` would see the new values.
  // The store may be fused with the computation before it (ewise_program_impl.h), which then
  // reads and writes each element at one index: an update such as θ − lr·g in place.
  const auto refuse = [&] {
    bad("output " + std::to_string(out) + " shares its buffer with input " + std::to_string(in) +
        " and the program reads that input after storing the output (in place, every read "
        "of the input must come first)");
  };
  bool views[kProgramRegisters] = {};
  bool stored = false;
  for (std::size_t k = 0; k + 4 < code.size(); k += 5) {
    const std::int32_t kind = code[k], dst = code[k + 2], a = code[k + 3], b = code[k + 4];
    const auto viewed = [&](std::int32_t r) {
      return r >= 0 && r < kProgramRegisters && views[r];
    };
    if (kind == kLoad) {
      if (stored && std::size_t(a) == in) refuse();
      if (dst >= 0 && dst < kProgramRegisters) views[dst] = std::size_t(a) == in;
      continue;
    }
    const bool reads = viewed(a) || (kind == kBinary && viewed(b));
    if (kind == kStore) {
      if (reads && (stored || std::size_t(dst) == out)) refuse();  // a copy onto itself too
      if (std::size_t(dst) == out) stored = true;
      continue;
    }
    if (stored && reads) refuse();
    if (dst >= 0 && dst < kProgramRegisters) views[dst] = false;
  }
}

namespace {

// One launch's checked pointers (at most 64 inputs and outputs, as the kernels take them).
struct Launch {
  DType t = DType::f32;
  std::int64_t n = 0;
  const void* ins[64];
  void* outs[64];
};

// Checks one launch's arrays: dtype, size, an output sharing an input's buffer only where
// check_in_place allows it, no two outputs sharing one.
Launch check_launch(const std::vector<const Array*>& ins, const std::vector<Array*>& outs,
                    const std::vector<std::int32_t>& code, std::int64_t n) {
  if (n < 0) bad("expected n >= 0, got " + std::to_string(n));
  if (outs.empty()) bad("expected at least one output");
  Launch launch;
  launch.n = n;
  const DType t = launch.t = outs[0]->dtype();
  if (is_low_precision(t)) bad(std::string("expected float32 or float64, got ") + dtype_name(t));
  if (ins.size() > 64 || outs.size() > 64) bad("expected at most 64 inputs and 64 outputs");
  for (std::size_t i = 0; i < ins.size(); ++i) {
    const Array* a = ins[i];
    if (a->dtype() != t || a->size() < std::size_t(n)) {
      bad("every input must be " + std::string(dtype_name(t)) + " with at least " +
          std::to_string(n) + " elements");
    }
    launch.ins[i] = a->data();
  }
  for (std::size_t j = 0; j < outs.size(); ++j) {
    Array* o = outs[j];
    if (o->dtype() != t || o->size() < std::size_t(n)) {
      bad("every output must be " + std::string(dtype_name(t)) + " with at least " +
          std::to_string(n) + " elements");
    }
    for (std::size_t i = 0; i < ins.size(); ++i) {
      if (ins[i]->data() == o->data()) check_in_place(code, i, j);
    }
    for (std::size_t k = 0; k < j; ++k) {  // see check_ewise_program: one store per buffer
      if (outs[k]->data() == o->data()) bad("two outputs share a buffer");
    }
    launch.outs[j] = o->data();
  }
  return launch;
}

void run_launch(const KernelTable& kernels, const Launch& launch,
                const std::vector<std::int32_t>& code, const std::vector<double>& scalars) {
  if (launch.n == 0) return;
  kernels.ewise_program(launch.t, launch.ins, launch.outs, code.data(), code.size() / 5,
                        scalars.data(), std::size_t(launch.n));
}

}  // namespace

void run_ewise_program(const KernelTable& kernels, const std::vector<const Array*>& ins,
                       const std::vector<Array*>& outs, const std::vector<std::int32_t>& code,
                       const std::vector<double>& scalars, std::int64_t n, bool checked) {
  const Launch launch = check_launch(ins, outs, code, n);
  if (!checked) check_ewise_program(code, ins.size(), outs.size(), scalars.size());
  if (n == 0) return;
  py::gil_scoped_release release;
  run_launch(kernels, launch, code, scalars);
}

namespace {

const KernelTable* const* g_kernels = nullptr;  // the module's kernel table (set once by bind)

// One item of a list argument (argument `at` of function `name`), converted; false with a
// Python error set.
bool item_of(const char* name, PyObject* item, Py_ssize_t at, Array** out) {
  if (!pyarray::is_array(item)) {
    PyErr_Format(PyExc_TypeError, "%s: expected Arrays in argument %zd, got %s", name, at,
                 Py_TYPE(item)->tp_name);
    return false;
  }
  *out = pyarray::array_of(item);
  return true;
}

bool item_of(const char* name, PyObject* item, Py_ssize_t at, const Array** out) {
  Array* a = nullptr;
  if (!item_of(name, item, at, &a)) return false;
  *out = a;
  return true;
}

// A TypeError naming the argument for an item that is not a number (an OverflowError stays).
bool not_a_number(const char* name, Py_ssize_t at, PyObject* item) {
  if (PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: expected numbers in argument %zd, got %s", name, at,
                 Py_TYPE(item)->tp_name);
  }
  return false;
}

bool item_of(const char* name, PyObject* item, Py_ssize_t at, double* out) {
  *out = PyFloat_AsDouble(item);
  return !(*out == -1.0 && PyErr_Occurred()) || not_a_number(name, at, item);
}

bool item_of(const char* name, PyObject* item, Py_ssize_t at, std::int32_t* out) {
  const long v = PyLong_AsLong(item);
  if (v == -1 && PyErr_Occurred()) return not_a_number(name, at, item);
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_Format(PyExc_OverflowError, "%s: code word %ld outside int32", name, v);
    return false;
  }
  *out = std::int32_t(v);
  return true;
}

// The items of a list or tuple `seq` (argument `at`) into `out`, converted one by one; false
// with a TypeError naming the function and what it expected when `seq` is neither.
template <class T>
bool items_of(const char* name, const char* expected, PyObject* seq, Py_ssize_t at,
              std::vector<T>* out) {
  PyObject** items = nullptr;
  Py_ssize_t n = 0;
  if (!fastcall::sequence_items(seq, &items, &n)) {
    PyErr_Format(PyExc_TypeError, "%s: expected (%s), got %s in argument %zd", name, expected,
                 Py_TYPE(seq)->tp_name, at);
    return false;
  }
  out->resize(std::size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!item_of(name, items[i], at, &(*out)[std::size_t(i)])) return false;
  }
  return true;
}

// ewise_program(ins, outs, code, scalars, n) as a fast call: optimizers run one per parameter
// and step, and pybind11's list conversions cost ~1.2 µs of each.
PyObject* ewise_program_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* name = "ewise_program";
  constexpr const char* expected =
      "ins: list[Array], outs: list[Array], code: list[int], scalars: list[float], n: int";
  if (nargs != 5) return fastcall::argument_error(name, expected, args, nargs);
  std::vector<const Array*> ins;
  std::vector<Array*> outs;
  std::vector<std::int32_t> code;
  std::vector<double> scalars;
  std::int64_t n = 0;
  if (!items_of(name, expected, args[0], 0, &ins) ||
      !items_of(name, expected, args[1], 1, &outs) ||
      !items_of(name, expected, args[2], 2, &code) ||
      !items_of(name, expected, args[3], 3, &scalars) ||
      !fastcall::int_args(name, expected, args, nargs, 4, 5, &n)) {
    return nullptr;
  }
  return fastcall::guarded(
      [&] { run_ewise_program(**g_kernels, ins, outs, code, scalars, n, false); }, nullptr);
}

// ewise_program_many(launches, code, scalars): one program over many groups of arrays, each
// launch an (ins, outs, n) as ewise_program takes them, run in order. Every launch is checked
// before the first runs, the GIL is released once: an optimizer's step over all its
// parameters is one call (~0.5 µs per parameter less than one call each).
PyObject* ewise_program_many_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* name = "ewise_program_many";
  constexpr const char* expected =
      "launches: list[tuple[list[Array], list[Array], int]], code: list[int], "
      "scalars: list[float]";
  if (nargs != 3) return fastcall::argument_error(name, expected, args, nargs);
  std::vector<std::int32_t> code;
  std::vector<double> scalars;
  if (!items_of(name, expected, args[1], 1, &code) ||
      !items_of(name, expected, args[2], 2, &scalars)) {
    return nullptr;
  }
  PyObject** items = nullptr;
  Py_ssize_t count = 0;
  if (!fastcall::sequence_arg(name, expected, args, nargs, 0, &items, &count)) return nullptr;
  constexpr const char* launch_expected = "ins: list[Array], outs: list[Array], n: int";
  std::vector<Launch> launches(static_cast<std::size_t>(count));
  std::vector<const Array*> ins;
  std::vector<Array*> outs;
  std::size_t checked_in = SIZE_MAX, checked_out = SIZE_MAX;  // program checked for these
  for (Py_ssize_t k = 0; k < count; ++k) {
    PyObject* item = items[k];
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
      PyErr_Format(PyExc_TypeError, "%s: expected launch %zd as a tuple (%s), got %s", name, k,
                   launch_expected, Py_TYPE(item)->tp_name);
      return nullptr;
    }
    std::int64_t n = 0;
    PyObject* n_item = PyTuple_GET_ITEM(item, 2);
    if (!items_of(name, launch_expected, PyTuple_GET_ITEM(item, 0), 0, &ins) ||
        !items_of(name, launch_expected, PyTuple_GET_ITEM(item, 1), 1, &outs) ||
        !fastcall::int_value(name, launch_expected, &n_item, 1, n_item, &n)) {
      return nullptr;
    }
    try {
      launches[std::size_t(k)] = check_launch(ins, outs, code, n);
      if (ins.size() != checked_in || outs.size() != checked_out) {
        check_ewise_program(code, ins.size(), outs.size(), scalars.size());
        checked_in = ins.size(), checked_out = outs.size();
      }
    } catch (const std::invalid_argument& e) {
      PyErr_Format(PyExc_ValueError, "%s (launch %zd)", e.what(), k);
      return nullptr;
    }
  }
  return fastcall::guarded(
      [&] {
        py::gil_scoped_release release;
        for (const Launch& launch : launches) run_launch(**g_kernels, launch, code, scalars);
      },
      nullptr);
}

}  // namespace

void bind_ewise_program(py::module_& m, const KernelTable* const* kernels) {
  g_kernels = kernels;
  static PyMethodDef table[] = {
      fastcall::method("ewise_program", ewise_program_call,
                       "(ins, outs, code, scalars, n): run an elementwise program over n "
                       "elements of each input Array, writing the output Arrays (see "
                       "ewise_program_impl.h for the format)."),
      fastcall::method("ewise_program_many", ewise_program_many_call,
                       "(launches, code, scalars): ewise_program(ins, outs, code, scalars, n) "
                       "for each (ins, outs, n) of launches, in order; all are checked before "
                       "the first runs."),
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(m.ptr(), table) != 0) throw py::error_already_set();
}

}  // namespace needle
