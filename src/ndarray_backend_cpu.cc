// pybind11 bindings of the C++ CPU backend (docs/backend_protocol.md).
//
// Each entry point checks the few things that would otherwise crash the process (sizes,
// dtypes, views reaching outside their buffer), then releases the GIL (when the work is large
// enough to be worth it: ReleaseGilIfLarge) and runs a kernel from the table chosen at import
// time (src/dispatch.cc: AVX-512, else AVX2+FMA+F16C, else baseline).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "allocator.h"
#include "allocator_py.h"
#include "array.h"
#include "array_py.h"
#include "fast_call_args.h"
#include "dispatch.h"
#include "ewise_program.h"
#include "kernels.h"
#include "ndarray_backend_fused.h"
#include "ndarray_backend_random.h"
#include "release_gil.h"
#include "strided.h"
#include "tiled.h"

namespace py = pybind11;

namespace needle {
namespace {

constexpr std::size_t kTile = 8;

const KernelTable* g_kernels = &base::table;

DType dtype_of(const py::object& dtype) { return pyarray::dtype_of(dtype.ptr()); }

void same_dtype(const char* op, const Array& a, const Array& out) {
  if (a.dtype() != out.dtype()) {
    throw py::type_error(std::string(op) + ": dtypes differ, expected " + dtype_name(out.dtype()) +
                         ", got " + dtype_name(a.dtype()));
  }
}

void big_enough(const char* op, const char* what, const Array& a, std::size_t need) {
  if (a.size() < need) {
    throw ShapeArgError(std::string(op) + ": " + what + " too small, expected at least " +
                        std::to_string(need) + " elements, got " + std::to_string(a.size()));
  }
}

// rows * cols elements of an operand, checked: a wrapped product would pass big_enough.
std::size_t elements(const char* op, const char* what, std::int64_t rows, std::int64_t cols) {
  std::int64_t n = 0;
  if (mul_overflows(rows, cols, &n) || n > kMaxViewElements) {
    throw SizeLimitError(std::string(op) + ": " + what + " too large, expected at most " +
                         std::to_string(kMaxViewElements) + " elements (2**62), got " +
                         std::to_string(rows) + " x " + std::to_string(cols));
  }
  return std::size_t(n);
}

// The element count of an (m x n) operand `a` of `op`: both dimensions >= 0, the product
// checked as elements() does.
std::size_t matrix_elements(const char* op, std::int64_t m, std::int64_t n) {
  if (m < 0 || n < 0) {
    throw ShapeArgError(std::string(op) + ": dimensions must be >= 0, got m=" +
                        std::to_string(m) + ", n=" + std::to_string(n));
  }
  return elements(op, "a", m, n);
}

View make_view(Dims shape, Dims strides, std::int64_t offset) {
  return View{std::move(shape), std::move(strides), offset};
}

// Raw bytes of `val` in dtype t (float16 and bfloat16 rounded to nearest even).
std::uint64_t scalar_bits(DType t, double val) {
  std::uint64_t bits = 0;
  if (t == DType::f64) std::memcpy(&bits, &val, 8);
  else if (t == DType::f32) { const float f = float(val); std::memcpy(&bits, &f, 4); }
  else {
    const std::uint16_t h = t == DType::bf16 ? double_to_bf16(val) : double_to_half(val);
    std::memcpy(&bits, &h, 2);
  }
  return bits;
}

// ---- entry points ------------------------------------------------------------------------

py::array to_numpy(const Array& a, Dims shape, Dims strides, std::int64_t offset) {
  const View v = make_view(std::move(shape), std::move(strides), offset);
  const std::size_t n = check_view("to_numpy", v, a.size());
  if (n > kMaxBufferBytes / itemsize(a.dtype())) {
    throw SizeLimitError("to_numpy: result too large, expected at most " +
                         std::to_string(kMaxBufferBytes) + " bytes (2**62), got " +
                         std::to_string(n) + " elements of " + dtype_name(a.dtype()));
  }
  py::array result(py::dtype(dtype_name(a.dtype())), v.shape);
  if (n) {
    void* dst = result.mutable_data();
    py::gil_scoped_release release;
    gather(itemsize(a.dtype()), a.data(), v, dst);
  }
  return result;
}

void from_numpy(const py::object& source, Array& out) {
  static py::object* contiguous =
      new py::object(py::module_::import("numpy").attr("ascontiguousarray"));  // never freed
  py::array arr = (*contiguous)(source, py::arg("dtype") = dtype_name(out.dtype()));
  if (std::size_t(arr.size()) < out.size()) {
    throw std::invalid_argument("from_numpy: source too small, expected at least " +
                                std::to_string(out.size()) + " elements, got " +
                                std::to_string(arr.size()));
  }
  const void* src = arr.data();
  py::gil_scoped_release release;
  std::memcpy(out.data(), src, out.size() * itemsize(out.dtype()));
}

template <class U>
void fill_bits(U* out, U value, std::size_t n) {
  parallel_range(n, kParallelMinElements, [&](std::size_t s, std::size_t e) {
    for (std::size_t i = s; i < e; ++i) out[i] = value;
  });
}

void fill(Array& out, double val) {
  const std::uint64_t bits = scalar_bits(out.dtype(), val);
  ReleaseGilIfLarge release(double(out.size()));
  switch (itemsize(out.dtype())) {
    case 2:
      return fill_bits(static_cast<std::uint16_t*>(out.data()), std::uint16_t(bits), out.size());
    case 4:
      return fill_bits(static_cast<std::uint32_t*>(out.data()), std::uint32_t(bits), out.size());
    default:
      return fill_bits(static_cast<std::uint64_t*>(out.data()), bits, out.size());
  }
}

void compact(const Array& a, Array& out, Dims shape, Dims strides, std::int64_t offset) {
  same_dtype("compact", a, out);
  const View v = make_view(std::move(shape), std::move(strides), offset);
  const std::size_t n = check_view("compact", v, a.size());
  big_enough("compact", "out", out, n);
  if (!n) return;
  ReleaseGilIfLarge release{double(n)};
  gather(itemsize(a.dtype()), a.data(), v, out.data());
}

void ewise_setitem(const Array& a, Array& out, Dims shape, Dims strides, std::int64_t offset) {
  same_dtype("ewise_setitem", a, out);
  const View v = make_view(std::move(shape), std::move(strides), offset);
  const std::size_t n = check_view("ewise_setitem", v, out.size());
  big_enough("ewise_setitem", "a", a, n);
  if (!n) return;
  ReleaseGilIfLarge release{double(n)};
  scatter(itemsize(a.dtype()), a.data(), v, out.data());
}

void scalar_setitem(std::int64_t size, double val, Array& out, Dims shape, Dims strides,
                    std::int64_t offset) {
  const View v = make_view(std::move(shape), std::move(strides), offset);
  const std::size_t n = check_view("scalar_setitem", v, out.size());
  if (size < 0 || std::size_t(size) != n) {
    throw ShapeArgError("scalar_setitem: size differs from the view, expected " +
                        std::to_string(n) + ", got " + std::to_string(size));
  }
  if (!n) return;
  const std::uint64_t bits = scalar_bits(out.dtype(), val);
  ReleaseGilIfLarge release{double(n)};
  scatter_value(itemsize(out.dtype()), &bits, v, out.data());
}

void binary(BinOp op, const char* name, const Array& a, const Array& b, Array& out) {
  same_dtype(name, a, out);
  same_dtype(name, b, out);
  big_enough(name, "a", a, out.size());
  big_enough(name, "b", b, out.size());
  ReleaseGilIfLarge release(double(out.size()));
  g_kernels->binary(op, out.dtype(), a.data(), b.data(), out.data(), out.size());
}

// out (m x n) = a (m x n) + row (n) added to every row: a linear layer's bias, without
// the broadcast copy of it that ewise_add would need. Each row is ewise_add's own kernel on
// n elements, so the sums are bitwise the broadcast addition's. out may be a (in place).
void add_rows(const Array& a, const Array& row, Array& out, std::int64_t m, std::int64_t n) {
  constexpr const char* op = "ewise_add_rows";
  same_dtype(op, a, out);
  same_dtype(op, row, out);
  const std::size_t total = matrix_elements(op, m, n), cols = std::size_t(n);
  big_enough(op, "a", a, total);
  big_enough(op, "out", out, total);
  big_enough(op, "row", row, cols);
  if (row.data() == out.data()) {
    throw std::invalid_argument(std::string(op) + ": out must not share memory with row");
  }
  if (!total) return;
  const std::size_t bytes = cols * itemsize(out.dtype());
  const auto* in = static_cast<const char*>(a.data());
  auto* dst = static_cast<char*>(out.data());
  // Short rows go `group` at a time against the row repeated `group` times: one kernel call
  // per ~1024 elements instead of one per row (a convolution's bias: 8192 rows of 16 took
  // ~60 us in calls alone). Each element is still one ewise_add of the same two values.
  const std::size_t group = std::max<std::size_t>(1, std::min<std::size_t>(
      std::size_t(m), 1024 / cols));
  std::vector<char> repeated;
  const void* pattern = row.data();
  if (group > 1) {
    repeated.resize(group * bytes);
    for (std::size_t g = 0; g < group; ++g) {
      std::memcpy(repeated.data() + g * bytes, row.data(), bytes);
    }
    pattern = repeated.data();
  }
  ReleaseGilIfLarge release(double(total));
  parallel_range(std::size_t(m), kParallelMinElements / cols + 1,
                 [&](std::size_t r0, std::size_t r1) {
                   std::size_t r = r0;
                   for (; r + group <= r1; r += group) {
                     g_kernels->binary(BinOp::add, out.dtype(), in + r * bytes, pattern,
                                       dst + r * bytes, group * cols);
                   }
                   for (; r < r1; ++r) {
                     g_kernels->binary(BinOp::add, out.dtype(), in + r * bytes, row.data(),
                                       dst + r * bytes, cols);
                   }
                 }, 1);
}

void scalar(BinOp op, bool reversed, const char* name, const Array& a, double val, Array& out) {
  same_dtype(name, a, out);
  big_enough(name, "a", a, out.size());
  ReleaseGilIfLarge release(double(out.size()));
  g_kernels->scalar(op, reversed, out.dtype(), a.data(), val, out.data(), out.size());
}

void unary(UnOp op, const char* name, const Array& a, Array& out) {
  same_dtype(name, a, out);
  big_enough(name, "a", a, out.size());
  ReleaseGilIfLarge release(double(out.size()));
  g_kernels->unary(op, out.dtype(), a.data(), out.data(), out.size());
}

void ewise_cast(const Array& a, Array& out) {
  big_enough("ewise_cast", "a", a, out.size());
  py::gil_scoped_release release;
  g_kernels->cast(a.dtype(), a.data(), out.dtype(), out.data(), out.size());
}

void check_matmul(const char* op, const Array& a, const Array& b, const Array& out,
                  std::int64_t m, std::int64_t n, std::int64_t p) {
  same_dtype(op, a, out);
  same_dtype(op, b, out);
  if (m < 0 || n < 0 || p < 0) {
    throw ShapeArgError(std::string(op) + ": dimensions must be >= 0, got m=" +
                        std::to_string(m) + ", n=" + std::to_string(n) + ", p=" +
                        std::to_string(p));
  }
  big_enough(op, "a", a, elements(op, "a", m, n));
  big_enough(op, "b", b, elements(op, "b", n, p));
  big_enough(op, "out", out, elements(op, "out", m, p));
  if (out.data() == a.data() || out.data() == b.data()) {
    throw std::invalid_argument(std::string(op) + ": out must not share memory with an input");
  }
}

void matmul(const Array& a, const Array& b, Array& out, std::int64_t m, std::int64_t n,
            std::int64_t p) {
  check_matmul("matmul", a, b, out, m, n, p);
  ReleaseGilIfLarge release(double(m) * double(n) * double(p));
  g_kernels->matmul(out.dtype(), a.data(), b.data(), out.data(), m, n, p);
}

// Element span a strided rows x cols view reaches (offset + last index + 1); strides >= 0.
// Each step is overflow-checked: a wrapped span would let the view read past its buffer.
std::size_t strided_extent(const char* op, const char* what, std::int64_t rows,
                           std::int64_t cols, std::int64_t offset, std::int64_t rs,
                           std::int64_t cs) {
  if (offset < 0 || rs < 0 || cs < 0) {
    throw ShapeArgError(std::string(op) + ": " + what + " offset and strides must be >= 0, " +
                        "got offset " + std::to_string(offset) + ", strides (" +
                        std::to_string(rs) + ", " + std::to_string(cs) + ")");
  }
  if (rows == 0 || cols == 0) return 0;
  std::int64_t row_reach = 0, col_reach = 0, span = 0;
  if (mul_overflows(rows - 1, rs, &row_reach) || mul_overflows(cols - 1, cs, &col_reach) ||
      add_overflows(offset, row_reach, &span) || add_overflows(span, col_reach, &span) ||
      add_overflows(span, 1, &span)) {
    throw BoundsError(std::string(op) + ": " + what + " reaches outside its buffer, got " +
                      std::to_string(rows) + " x " + std::to_string(cols) + " with offset " +
                      std::to_string(offset) + ", strides (" + std::to_string(rs) + ", " +
                      std::to_string(cs) + "): the span overflows int64");
  }
  return std::size_t(span);
}

void matmul_strided(const Array& a, const Array& b, Array& out, std::int64_t m, std::int64_t n,
                    std::int64_t p, std::int64_t a_offset, std::int64_t ars, std::int64_t acs,
                    std::int64_t b_offset, std::int64_t brs, std::int64_t bcs) {
  const char* op = "matmul_strided";
  same_dtype(op, a, out);
  same_dtype(op, b, out);
  if (m < 0 || n < 0 || p < 0) {
    throw ShapeArgError(std::string(op) + ": dimensions must be >= 0, got m=" +
                        std::to_string(m) + ", n=" + std::to_string(n) + ", p=" +
                        std::to_string(p));
  }
  if (is_low_precision(out.dtype())) {
    throw std::invalid_argument(std::string(op) + ": expected float32 or float64, got " +
                                dtype_name(out.dtype()));
  }
  big_enough(op, "a", a, strided_extent(op, "a", m, n, a_offset, ars, acs));
  big_enough(op, "b", b, strided_extent(op, "b", n, p, b_offset, brs, bcs));
  big_enough(op, "out", out, elements(op, "out", m, p));
  if (out.data() == a.data() || out.data() == b.data()) {
    throw std::invalid_argument(std::string(op) + ": out must not share memory with an input");
  }
  const std::size_t item = itemsize(out.dtype());
  const char* ap = static_cast<const char*>(a.data()) + std::size_t(a_offset) * item;
  const char* bp = static_cast<const char*>(b.data()) + std::size_t(b_offset) * item;
  ReleaseGilIfLarge release(double(m) * double(n) * double(p));
  g_kernels->matmul_strided(out.dtype(), ap, ars, acs, bp, brs, bcs, out.data(), m, n, p);
}

void matmul_tiled_entry(const Array& a, const Array& b, Array& out, std::int64_t m,
                        std::int64_t n, std::int64_t p) {
  check_matmul("matmul_tiled", a, b, out, m, n, p);
  const auto t = std::int64_t(kTile);
  if (m % t || n % t || p % t) {
    throw std::invalid_argument("matmul_tiled: expected m, n, p multiples of " +
                                std::to_string(kTile) + ", got m=" + std::to_string(m) +
                                ", n=" + std::to_string(n) + ", p=" + std::to_string(p));
  }
  py::gil_scoped_release release;
  matmul_tiled(*g_kernels, out.dtype(), a.data(), b.data(), out.data(), m, n, p, kTile);
}

void reduce(RedOp op, const char* name, const Array& a, Array& out, std::int64_t reduce_size) {
  same_dtype(name, a, out);
  if (reduce_size < 0) {
    throw ShapeArgError(std::string(name) + ": reduce_size must be >= 0, got " +
                        std::to_string(reduce_size));
  }
  big_enough(name, "a", a, elements(name, "a", std::int64_t(out.size()), reduce_size));
  ReleaseGilIfLarge release(double(out.size()) * double(reduce_size));
  g_kernels->reduce(op, out.dtype(), a.data(), out.data(), out.size(), std::size_t(reduce_size));
}

// out (n) = the m rows of a (m x n) added up: the sum over an array's leading axes (a linear
// layer's bias gradient) in one pass, without the ones-vector product NDArray used for it.
void sum_leading(const Array& a, Array& out, std::int64_t m, std::int64_t n) {
  constexpr const char* op = "reduce_sum_leading";
  same_dtype(op, a, out);
  big_enough(op, "a", a, matrix_elements(op, m, n));
  big_enough(op, "out", out, std::size_t(n));
  if (n && a.data() == out.data()) {
    throw std::invalid_argument(std::string(op) + ": out must not share memory with a");
  }
  ReleaseGilIfLarge release(double(m) * double(n));
  g_kernels->sum_leading(out.dtype(), a.data(), out.data(), std::size_t(m), std::size_t(n));
}

// The class `name` of needle._core.errors, or `fallback` when needle is not importable (the
// module used on its own); resolved once, kept for the life of the process.
PyObject* needle_error(const char* name, PyObject* fallback) {
  try {
    return py::object(py::module_::import("needle._core.errors").attr(name)).release().ptr();
  } catch (py::error_already_set&) {
    return fallback;
  }
}

// Maps the checks' C++ exceptions (common.h) onto needle's error classes.
void translate_check_errors(std::exception_ptr p) {
  static PyObject* const size_limit = needle_error("SizeLimitError", PyExc_ValueError);
  static PyObject* const bounds = needle_error("IndexOutOfRange", PyExc_IndexError);
  static PyObject* const shape = needle_error("ShapeError", PyExc_ValueError);
  static PyObject* const memory = needle_error("OutOfMemoryError", PyExc_MemoryError);
  try {
    if (p) std::rethrow_exception(p);
  } catch (const SizeLimitError& e) {
    PyErr_SetString(size_limit, e.what());
  } catch (const BoundsError& e) {
    PyErr_SetString(bounds, e.what());
  } catch (const ShapeArgError& e) {
    PyErr_SetString(shape, e.what());
  } catch (const OutOfMemory& e) {
    PyErr_SetString(memory, e.what());
  }
}

#include "kernel_list_py.h"
#include "fast_calls_py.h"

}  // namespace
}  // namespace needle

PYBIND11_MODULE(ndarray_backend_cpu, m) {
  using namespace needle;
  namespace nd = needle;
  m.doc() = "needle C++ CPU backend (see docs/backend_protocol.md)";
  m.attr("__device_name__") = "cpu";
  m.attr("__tile_size__") = kTile;

  py::register_exception_translator(&nd::translate_check_errors);

  const char* isa = std::getenv("NEEDLE_CPU_ISA");
  g_kernels = &select_isa(isa && *isa ? isa : "auto");

  pyarray::init_array_type(m, &nd::translate_check_errors);
  pyalloc::bind(m);
  // new_array, fill, compact, the setitems, ewise_*, scalar_*, reduce_*, matmul and
  // matmul_strided: bound without pybind11's dispatcher (fast_calls_py.h)
  nd::fast::bind(m);

  m.def("to_numpy", &nd::to_numpy, py::arg("a"), py::arg("shape"), py::arg("strides"),
        py::arg("offset"));
  m.def("from_numpy", &nd::from_numpy, py::arg("np_array"), py::arg("out"));

  m.def("ewise_cast", &nd::ewise_cast);
  m.def("matmul_tiled", &nd::matmul_tiled_entry);

  m.def("set_num_threads", &nd::set_num_threads, py::arg("n"));
  m.def("get_num_threads", &nd::num_threads);
  m.def("_parallel_min_flops", &nd::parallel_min_flops,
        "Flops from which a matmul or convolution uses every kernel thread (src/threads.cc).");
  // Private: which kernel build runs ("avx512", "avx2" or "baseline"); tests use it to cover
  // every build the CPU runs, benchmarks to print it with the matmul micro-kernels.
  m.def("_get_isa", [] { return std::string(g_kernels->name); });
  m.def("_set_isa", [](const std::string& name) { g_kernels = &select_isa(name); });
  nd::bind_fused(m, &g_kernels);
  nd::bind_random(m, &g_kernels);
  nd::bind_kernel_list(m);
  m.def("_available_isas", &nd::available_isas);
  m.def("_kernel_info", [] {
    py::dict info;
    info["isa"] = g_kernels->name;
    info["sgemm"] = g_kernels->sgemm_name;
    info["dgemm"] = g_kernels->dgemm_name;
    return info;
  });
}
