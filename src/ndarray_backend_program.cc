// Entry point of ewise_program, the fused elementwise kernel of needle.compile's kernel
// programs (see ewise_program_impl.h for the instruction format). Everything a bad program
// could crash on is checked here, once per call: dtypes, sizes, register and operand indices,
// op codes, and that no output aliases an input (a block would read what it already wrote).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "array.h"
#include "array_py.h"
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
    for (const Array* a : ins) {
      if (a->data() == o->data()) bad("an output shares its buffer with an input");
    }
    out_ptrs[j] = o->data();
  }
  if (!checked) check_ewise_program(code, ins.size(), outs.size(), scalars.size());
  if (n == 0) return;
  py::gil_scoped_release release;
  kernels.ewise_program(t, in_ptrs, out_ptrs, code.data(), code.size() / 5, scalars.data(),
                        std::size_t(n));
}

void bind_ewise_program(py::module_& m, const KernelTable* const* kernels) {
  m.def("ewise_program", [kernels](const std::vector<const Array*>& ins,
                                   const std::vector<Array*>& outs,
                                   const std::vector<std::int32_t>& code,
                                   const std::vector<double>& scalars, std::int64_t n) {
    run_ewise_program(**kernels, ins, outs, code, scalars, n, false);
  }, py::arg("ins"), py::arg("outs"), py::arg("code"), py::arg("scalars"), py::arg("n"));
}

}  // namespace needle
