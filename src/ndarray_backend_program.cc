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

void run_ewise_program(const KernelTable& kernels, const std::vector<const Array*>& ins,
                       const std::vector<Array*>& outs, const std::vector<std::int32_t>& code,
                       const std::vector<double>& scalars, std::int64_t n, bool checked) {
  if (n < 0) bad("expected n >= 0, got " + std::to_string(n));
  if (outs.empty()) bad("expected at least one output");
  const DType t = outs[0]->dtype();
  if (t == DType::f16) bad("expected float32 or float64, got float16");
  const void* in_ptrs[64];
  void* out_ptrs[64];
  if (ins.size() > 64 || outs.size() > 64) bad("expected at most 64 inputs and 64 outputs");
  for (std::size_t i = 0; i < ins.size(); ++i) {
    const Array* a = ins[i];
    if (a->dtype() != t || a->size() < std::size_t(n)) {
      bad("every input must be " + std::string(dtype_name(t)) + " with at least " +
          std::to_string(n) + " elements");
    }
    in_ptrs[i] = a->data();
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
    out_ptrs[j] = o->data();
  }
  if (!checked) check_ewise_program(code, ins.size(), outs.size(), scalars.size());
  if (n == 0) return;
  py::gil_scoped_release release;
  kernels.ewise_program(t, in_ptrs, out_ptrs, code.data(), code.size() / 5, scalars.data(),
                        std::size_t(n));
}

namespace {

const KernelTable* const* g_kernels = nullptr;  // the module's kernel table (set once by bind)

// One item of a list argument (argument `at`), converted; false with a Python error set.
bool item_of(PyObject* item, Py_ssize_t at, Array** out) {
  if (!pyarray::is_array(item)) {
    PyErr_Format(PyExc_TypeError, "ewise_program: expected Arrays in argument %zd, got %s", at,
                 Py_TYPE(item)->tp_name);
    return false;
  }
  *out = pyarray::array_of(item);
  return true;
}

bool item_of(PyObject* item, Py_ssize_t at, const Array** out) {
  Array* a = nullptr;
  if (!item_of(item, at, &a)) return false;
  *out = a;
  return true;
}

// A TypeError naming the argument for an item that is not a number (an OverflowError stays).
bool not_a_number(Py_ssize_t at, PyObject* item) {
  if (PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "ewise_program: expected numbers in argument %zd, got %s", at,
                 Py_TYPE(item)->tp_name);
  }
  return false;
}

bool item_of(PyObject* item, Py_ssize_t at, double* out) {
  *out = PyFloat_AsDouble(item);
  return !(*out == -1.0 && PyErr_Occurred()) || not_a_number(at, item);
}

bool item_of(PyObject* item, Py_ssize_t at, std::int32_t* out) {
  const long v = PyLong_AsLong(item);
  if (v == -1 && PyErr_Occurred()) return not_a_number(at, item);
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_Format(PyExc_OverflowError, "ewise_program: code word %ld outside int32", v);
    return false;
  }
  *out = std::int32_t(v);
  return true;
}

// A list or tuple argument args[at] into `out`, item by item.
template <class T>
bool list_arg(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t at, const char* expected,
              std::vector<T>* out) {
  PyObject** items = nullptr;
  Py_ssize_t n = 0;
  if (!fastcall::sequence_arg("ewise_program", expected, args, nargs, at, &items, &n)) {
    return false;
  }
  out->resize(std::size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!item_of(items[i], at, &(*out)[std::size_t(i)])) return false;
  }
  return true;
}

// ewise_program(ins, outs, code, scalars, n) as a fast call: optimizers run one per parameter
// and step, and pybind11's list conversions cost ~1.2 µs of each.
PyObject* ewise_program_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* expected =
      "ins: list[Array], outs: list[Array], code: list[int], scalars: list[float], n: int";
  if (nargs != 5) return fastcall::argument_error("ewise_program", expected, args, nargs);
  std::vector<const Array*> ins;
  std::vector<Array*> outs;
  std::vector<std::int32_t> code;
  std::vector<double> scalars;
  std::int64_t n = 0;
  if (!list_arg(args, nargs, 0, expected, &ins) || !list_arg(args, nargs, 1, expected, &outs) ||
      !list_arg(args, nargs, 2, expected, &code) || !list_arg(args, nargs, 3, expected, &scalars) ||
      !fastcall::int_args("ewise_program", expected, args, nargs, 4, 5, &n)) {
    return nullptr;
  }
  return fastcall::guarded(
      [&] { run_ewise_program(**g_kernels, ins, outs, code, scalars, n, false); }, nullptr);
}

}  // namespace

void bind_ewise_program(py::module_& m, const KernelTable* const* kernels) {
  g_kernels = kernels;
  static PyMethodDef table[] = {
      fastcall::method("ewise_program", ewise_program_call,
                       "(ins, outs, code, scalars, n): run an elementwise program over n "
                       "elements of each input Array, writing the output Arrays (see "
                       "ewise_program_impl.h for the format)."),
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(m.ptr(), table) != 0) throw py::error_already_set();
}

}  // namespace needle
