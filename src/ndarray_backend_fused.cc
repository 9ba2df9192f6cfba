// Entry points of the fused kernels (docs/backend_protocol.md, "Fused kernels"). Like the other
// entry points they check what would otherwise crash the process (dtypes, sizes, geometry,
// aliasing), release the GIL and run the kernel of the current table.
#include "ndarray_backend_fused.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "array.h"
#include "array_py.h"
#include "fast_call_args.h"

namespace py = pybind11;

namespace needle {
namespace {

void check_float(const char* op, const Array& a) {
  if (is_low_precision(a.dtype())) {
    throw std::invalid_argument(std::string(op) + ": expected float32 or float64, got " +
                                dtype_name(a.dtype()));
  }
}

void check_same(const char* op, const Array& a, const Array& ref) {
  if (a.dtype() != ref.dtype()) {
    throw py::type_error(std::string(op) + ": dtypes differ, expected " +
                         dtype_name(ref.dtype()) + ", got " + dtype_name(a.dtype()));
  }
}

void check_size(const char* op, const char* what, const Array& a, std::size_t need) {
  if (a.size() < need) {
    throw std::invalid_argument(std::string(op) + ": " + what + " too small, expected at least " +
                                std::to_string(need) + " elements, got " +
                                std::to_string(a.size()));
  }
}

// check_size for each (name, array) against `need` elements.
void check_sizes(const char* op, std::size_t need,
                 std::initializer_list<std::pair<const char*, const Array*>> arrays) {
  for (const auto& [what, a] : arrays) check_size(op, what, *a, need);
}

void check_distinct(const char* op, const Array& out, const Array& a, const Array& b) {
  if (out.data() == a.data() || out.data() == b.data()) {
    throw std::invalid_argument(std::string(op) + ": out must not share memory with an input");
  }
}

// The elements [offset, offset + need) of an optional operand `what` (null when absent):
// same dtype as `ref`, inside the buffer, not one of the outputs.
const void* optional_rows(const char* op, const char* what, const Array* a, std::int64_t offset,
                          std::size_t need, const Array& ref,
                          std::initializer_list<const Array*> outs) {
  if (a == nullptr) return nullptr;
  check_same(op, *a, ref);
  if (offset < 0 || std::size_t(offset) > a->size() || a->size() - std::size_t(offset) < need) {
    throw std::invalid_argument(std::string(op) + ": " + what + " too small, expected " +
                                std::to_string(need) + " elements from offset " +
                                std::to_string(offset) + ", got a buffer of " +
                                std::to_string(a->size()));
  }
  for (const Array* o : outs) {
    if (o->data() == a->data()) {
      throw std::invalid_argument(std::string(op) + ": " + what +
                                  " must not share memory with an output");
    }
  }
  return static_cast<const char*>(a->data()) + std::size_t(offset) * itemsize(a->dtype());
}

// The geometry from the Python arguments, validated (sizes >= 1, stride >= 1, pad >= 0, the
// kernel fits the padded input); overflow of the products is the caller's (NDArray) check.
ConvGeom make_geom(const char* op, std::int64_t n, std::int64_t h, std::int64_t w,
                   std::int64_t c, std::int64_t kh, std::int64_t kw, std::int64_t cout,
                   std::int64_t stride, std::int64_t pad) {
  if (n < 1 || h < 1 || w < 1 || c < 1 || kh < 1 || kw < 1 || cout < 1 || stride < 1 ||
      pad < 0 || h + 2 * pad < kh || w + 2 * pad < kw) {
    throw std::invalid_argument(
        std::string(op) + ": expected sizes >= 1, stride >= 1, pad >= 0 and a kernel that fits "
        "the padded input, got input (" + std::to_string(n) + ", " + std::to_string(h) + ", " +
        std::to_string(w) + ", " + std::to_string(c) + "), kernel (" + std::to_string(kh) +
        ", " + std::to_string(kw) + ", " + std::to_string(cout) + "), stride " +
        std::to_string(stride) + ", pad " + std::to_string(pad));
  }
  ConvGeom g{};
  g.n = std::size_t(n); g.h = std::size_t(h); g.w = std::size_t(w); g.c = std::size_t(c);
  g.kh = std::size_t(kh); g.kw = std::size_t(kw); g.cout = std::size_t(cout);
  g.stride = std::size_t(stride); g.pad = std::size_t(pad);
  g.ho = (g.h + 2 * g.pad - g.kh) / g.stride + 1;
  g.wo = (g.w + 2 * g.pad - g.kw) / g.stride + 1;
  g.set_compact_strides();
  return g;
}

// The operand `what` of a convolution, dims (N, H, W, C) = `dims`: compact when `view` is None,
// else the view (offset, stride_n, stride_h, stride_w, stride_c) of its buffer (element units,
// strides >= 0), checked to lie inside it. Writes the strides (a unit dim's stride made the
// compact one, as it is never used) and returns the data pointer at the offset.
const void* conv_operand(const char* op, const char* what, const Array& a, py::handle view,
                         const std::size_t (&dims)[4], std::size_t (&strides)[4]) {
  const std::size_t compact[4] = {dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1};
  if (view.is_none()) {
    check_size(op, what, a, dims[0] * compact[0]);
    std::copy(compact, compact + 4, strides);
    return a.data();
  }
  std::vector<std::int64_t> values;
  if (py::isinstance<py::sequence>(view) && !py::isinstance<py::str>(view)) {
    for (py::handle item : py::reinterpret_borrow<py::sequence>(view)) {
      values.push_back(item.cast<std::int64_t>());
    }
  }
  if (values.size() != 5 || *std::min_element(values.begin(), values.end()) < 0) {
    throw std::invalid_argument(std::string(op) + ": " + what + "_view must be (offset, and "
                                "four strides), all >= 0, got " + std::string(py::str(view)));
  }
  // the last element the view reads, as a double first: no wrap-around on absurd strides
  double last = double(values[0]);
  for (int i = 0; i < 4; ++i) last += double(dims[i] - 1) * double(values[i + 1]);
  if (last >= double(a.size())) {
    throw std::invalid_argument(std::string(op) + ": " + what + "_view reads past its buffer, "
                                "expected its last element below " + std::to_string(a.size()) +
                                ", got " + std::to_string(std::int64_t(last)));
  }
  for (int i = 0; i < 4; ++i) strides[i] = dims[i] == 1 ? compact[i] : std::size_t(values[i + 1]);
  return static_cast<const char*>(a.data()) + std::size_t(values[0]) * itemsize(a.dtype());
}

#define NEEDLE_GEOM_ARGS                                                                     \
  std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c, std::int64_t kh,           \
      std::int64_t kw, std::int64_t cout, std::int64_t stride, std::int64_t pad
#define NEEDLE_GEOM_VALUES n, h, w, c, kh, kw, cout, stride, pad
#define NEEDLE_GEOM_NAMES                                                                    \
  py::arg("n"), py::arg("h"), py::arg("wd"), py::arg("c"), py::arg("kh"), py::arg("kw"),    \
      py::arg("cout"), py::arg("stride"), py::arg("pad")

}  // namespace

void bind_lstm(py::module_& m, const KernelTable* const* kernels);
void bind_batch_norm(py::module_& m, const KernelTable* const* kernels);
void bind_softmax_xent(py::module_& m, const KernelTable* const* kernels);
void bind_embedding(py::module_& m);
void bind_ewise_program(py::module_& m, const KernelTable* const* kernels);

void bind_fused(py::module_& m, const KernelTable* const* kernels) {
  bind_lstm(m, kernels);
  bind_ewise_program(m, kernels);
  bind_embedding(m);
  bind_batch_norm(m, kernels);
  bind_softmax_xent(m, kernels);
  // out = conv(x, w) (+ bias on every pixel: conv2d_forward_bias, nn.Conv's bias added as
  // the kernel stores its output, where a separate pass would read and write it again)
  const auto forward = [kernels](const char* op, const Array& x, const Array& wt,
                                 const Array* bias, Array& out, ConvGeom g, py::handle x_view) {
    check_float(op, out);
    check_same(op, x, out);
    check_same(op, wt, out);
    const void* xp = conv_operand(op, "x", x, x_view, {g.n, g.h, g.w, g.c}, g.xs);
    check_size(op, "w", wt, g.k() * g.cout);
    check_size(op, "out", out, g.pixels() * g.cout);
    check_distinct(op, out, x, wt);
    if (bias) {
      check_same(op, *bias, out);
      check_size(op, "bias", *bias, g.cout);
      check_distinct(op, out, *bias, *bias);
      g.bias = bias->data();
    }
    py::gil_scoped_release release;
    (*kernels)->conv_forward(out.dtype(), xp, wt.data(), out.data(), g);
  };
  m.def("conv2d_forward", [forward](const Array& x, const Array& wt, Array& out,
                                    NEEDLE_GEOM_ARGS, py::handle x_view) {
    const char* op = "conv2d_forward";
    forward(op, x, wt, nullptr, out, make_geom(op, NEEDLE_GEOM_VALUES), x_view);
  }, py::arg("x"), py::arg("w"), py::arg("out"), NEEDLE_GEOM_NAMES, py::kw_only(),
     py::arg("x_view") = py::none());
  m.def("conv2d_forward_bias", [forward](const Array& x, const Array& wt, const Array& bias,
                                         Array& out, NEEDLE_GEOM_ARGS, py::handle x_view) {
    const char* op = "conv2d_forward_bias";
    forward(op, x, wt, &bias, out, make_geom(op, NEEDLE_GEOM_VALUES), x_view);
  }, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out"), NEEDLE_GEOM_NAMES,
     py::kw_only(), py::arg("x_view") = py::none());
  m.def("conv2d_weight_grad", [kernels](const Array& x, const Array& dy, Array& dw,
                                        NEEDLE_GEOM_ARGS, py::handle x_view,
                                        py::handle dy_view) {
    const char* op = "conv2d_weight_grad";
    ConvGeom g = make_geom(op, NEEDLE_GEOM_VALUES);
    check_float(op, dw);
    check_same(op, x, dw);
    check_same(op, dy, dw);
    const void* xp = conv_operand(op, "x", x, x_view, {g.n, g.h, g.w, g.c}, g.xs);
    const void* dyp = conv_operand(op, "dy", dy, dy_view, {g.n, g.ho, g.wo, g.cout}, g.dys);
    check_size(op, "dw", dw, g.k() * g.cout);
    check_distinct(op, dw, x, dy);
    py::gil_scoped_release release;
    (*kernels)->conv_weight_grad(dw.dtype(), xp, dyp, dw.data(), g);
  }, py::arg("x"), py::arg("dy"), py::arg("dw"), NEEDLE_GEOM_NAMES, py::kw_only(),
     py::arg("x_view") = py::none(), py::arg("dy_view") = py::none());
  m.def("conv2d_input_grad", [kernels](const Array& dy, const Array& wt, Array& dx,
                                       NEEDLE_GEOM_ARGS, py::handle dy_view) {
    const char* op = "conv2d_input_grad";
    ConvGeom g = make_geom(op, NEEDLE_GEOM_VALUES);
    check_float(op, dx);
    check_same(op, dy, dx);
    check_same(op, wt, dx);
    const void* dyp = conv_operand(op, "dy", dy, dy_view, {g.n, g.ho, g.wo, g.cout}, g.dys);
    check_size(op, "w", wt, g.k() * g.cout);
    check_size(op, "dx", dx, g.n * g.h * g.w * g.c);
    check_distinct(op, dx, dy, wt);
    py::gil_scoped_release release;
    (*kernels)->conv_input_grad(dx.dtype(), dyp, wt.data(), dx.data(), g);
  }, py::arg("dy"), py::arg("w"), py::arg("dx"), NEEDLE_GEOM_NAMES, py::kw_only(),
     py::arg("dy_view") = py::none());
  // x_view / dy_view above: ops.conv hands strided operands over without a compact copy
  m.attr("conv2d_takes_views") = true;
}

void bind_lstm(py::module_& m, const KernelTable* const* kernels) {
  m.def("lstm_cell_forward", [kernels](const Array& z, const Array* bias, const Array& c,
                                       Array& h_out, Array& c_out, Array& gates_out,
                                       Array& tanh_c_out, std::int64_t batch,
                                       std::int64_t hidden, const Array* z_add,
                                       std::int64_t z_add_offset) {
    const char* op = "lstm_cell_forward";
    if (batch < 0 || hidden < 0) {
      throw std::invalid_argument(std::string(op) + ": expected batch, hidden >= 0, got " +
                                  std::to_string(batch) + ", " + std::to_string(hidden));
    }
    const std::size_t rows = std::size_t(batch), h = std::size_t(hidden);
    check_float(op, z);
    for (const Array* a : {&c, static_cast<const Array*>(&h_out),
                           static_cast<const Array*>(&c_out),
                           static_cast<const Array*>(&gates_out),
                           static_cast<const Array*>(&tanh_c_out)}) {
      check_same(op, *a, z);
    }
    check_size(op, "z", z, rows * 4 * h);
    check_size(op, "c", c, rows * h);
    check_size(op, "h_out", h_out, rows * h);
    check_size(op, "c_out", c_out, rows * h);
    check_size(op, "gates_out", gates_out, rows * 4 * h);
    check_size(op, "tanh_c_out", tanh_c_out, rows * h);
    if (bias) {
      check_same(op, *bias, z);
      check_size(op, "bias", *bias, 4 * h);
    }
    const void* bias_data = bias ? bias->data() : nullptr;
    const void* add = optional_rows(op, "z_add", z_add, z_add_offset, rows * 4 * h, z,
                                    {&h_out, &c_out, &gates_out, &tanh_c_out});
    py::gil_scoped_release release;
    (*kernels)->lstm_forward(z.dtype(), z.data(), add, bias_data, c.data(), h_out.data(),
                             c_out.data(), gates_out.data(), tanh_c_out.data(), rows, h);
  }, py::arg("z"), py::arg("bias").none(true), py::arg("c"), py::arg("h_out"),
     py::arg("c_out"), py::arg("gates_out"), py::arg("tanh_c_out"), py::arg("batch"),
     py::arg("hidden"), py::arg("z_add").none(true) = py::none(), py::arg("z_add_offset") = 0);
  m.def("lstm_cell_backward", [kernels](const Array& gates, const Array& tanh_c,
                                        const Array& c, const Array& dh, const Array& dc,
                                        Array& dz_out, Array& dc_prev_out, std::int64_t batch,
                                        std::int64_t hidden, const Array* dh_add,
                                        std::int64_t dh_add_offset) {
    const char* op = "lstm_cell_backward";
    if (batch < 0 || hidden < 0) {
      throw std::invalid_argument(std::string(op) + ": expected batch, hidden >= 0, got " +
                                  std::to_string(batch) + ", " + std::to_string(hidden));
    }
    const std::size_t rows = std::size_t(batch), h = std::size_t(hidden);
    check_float(op, gates);
    for (const Array* a : {&tanh_c, &c, &dh, &dc, static_cast<const Array*>(&dz_out),
                           static_cast<const Array*>(&dc_prev_out)}) {
      check_same(op, *a, gates);
    }
    check_size(op, "gates", gates, rows * 4 * h);
    check_size(op, "tanh_c", tanh_c, rows * h);
    check_size(op, "c", c, rows * h);
    check_size(op, "dh", dh, rows * h);
    check_size(op, "dc", dc, rows * h);
    check_size(op, "dz_out", dz_out, rows * 4 * h);
    check_size(op, "dc_prev_out", dc_prev_out, rows * h);
    const void* add = optional_rows(op, "dh_add", dh_add, dh_add_offset, rows * h, gates,
                                    {&dz_out, &dc_prev_out});
    py::gil_scoped_release release;
    (*kernels)->lstm_backward(gates.dtype(), gates.data(), tanh_c.data(), c.data(), dh.data(),
                              add, dc.data(), dz_out.data(), dc_prev_out.data(), rows, h);
  }, py::arg("gates"), py::arg("tanh_c"), py::arg("c"), py::arg("dh"), py::arg("dc"),
     py::arg("dz_out"), py::arg("dc_prev_out"), py::arg("batch"), py::arg("hidden"),
     py::arg("dh_add").none(true) = py::none(), py::arg("dh_add_offset") = 0);
}

namespace {

// (N, C, S) from Python ints: each >= 0 and N*C*S without overflow (an Array never holds more
// than 2**62 bytes, so a product past that is refused before any size check reads it).
void bn_dims(const char* op, std::int64_t n, std::int64_t c, std::int64_t s, std::size_t* count) {
  std::int64_t nc = 0, total = 0;
  if (n < 0 || c < 0 || s < 0 || __builtin_mul_overflow(n, c, &nc) ||
      __builtin_mul_overflow(nc, s, &total)) {
    throw std::invalid_argument(std::string(op) + ": expected sizes n, c, s >= 0 whose product "
                                "fits in 64 bits, got " + std::to_string(n) + ", " +
                                std::to_string(c) + ", " + std::to_string(s));
  }
  *count = std::size_t(total);
}

const KernelTable* const* g_bn_kernels = nullptr;  // the module's kernel table (set by bind)

void batch_norm_forward(const Array& x, const Array& w, const Array& b, Array& y, Array& mean,
                        Array& var, Array& invstd, std::int64_t n, std::int64_t c,
                        std::int64_t s, double eps) {
  const KernelTable* const* kernels = g_bn_kernels;
  const char* op = "batch_norm_forward";
  std::size_t total = 0;
  bn_dims(op, n, c, s, &total);
  if (!(eps >= 0.0)) {
    throw std::invalid_argument(std::string(op) + ": expected eps >= 0, got " +
                                std::to_string(eps));
  }
  check_float(op, x);
  for (const Array* a : {&w, &b, static_cast<const Array*>(&y),
                         static_cast<const Array*>(&mean), static_cast<const Array*>(&var),
                         static_cast<const Array*>(&invstd)}) {
    check_same(op, *a, x);
  }
  const std::size_t ch = std::size_t(c);
  check_sizes(op, total, {{"x", &x}, {"y", &y}});
  check_sizes(op, ch, {{"w", &w}, {"b", &b}, {"mean", &mean}, {"var", &var},
                       {"invstd", &invstd}});
  check_distinct(op, y, x, w);
  if (y.data() == b.data()) {
    throw std::invalid_argument(std::string(op) + ": out must not share memory with an input");
  }
  if (total == 0) return;
  py::gil_scoped_release release;
  (*kernels)->bn_forward(x.dtype(), x.data(), w.data(), b.data(), y.data(), mean.data(),
                         var.data(), invstd.data(), std::size_t(n), ch, std::size_t(s), eps);
}

void batch_norm_backward(const Array& dy, const Array& x, const Array& w, const Array& mean,
                         const Array& invstd, Array& dx, Array& dw, Array& db, std::int64_t n,
                         std::int64_t c, std::int64_t s) {
  const KernelTable* const* kernels = g_bn_kernels;
  const char* op = "batch_norm_backward";
  std::size_t total = 0;
  bn_dims(op, n, c, s, &total);
  check_float(op, x);
  for (const Array* a : {&dy, &w, &mean, &invstd, static_cast<const Array*>(&dx),
                         static_cast<const Array*>(&dw), static_cast<const Array*>(&db)}) {
    check_same(op, *a, x);
  }
  const std::size_t ch = std::size_t(c);
  check_sizes(op, total, {{"dy", &dy}, {"x", &x}, {"dx", &dx}});
  check_sizes(op, ch, {{"w", &w}, {"mean", &mean}, {"invstd", &invstd}, {"dw", &dw},
                       {"db", &db}});
  check_distinct(op, dx, dy, x);
  if (total == 0) return;
  py::gil_scoped_release release;
  (*kernels)->bn_backward(x.dtype(), dy.data(), x.data(), w.data(), mean.data(),
                          invstd.data(), dx.data(), dw.data(), db.data(), std::size_t(n), ch,
                          std::size_t(s));
}

// Both as fast calls (positional arguments; a TypeError naming the function, what it expected
// and the types it got): a batch-norm layer runs each once per training step, and pybind11's
// dispatcher cost ~0.7 us of each call. Eleven arguments each: `n_arrays` Arrays, then the
// sizes n, c, s into `dims` (then eps for the forward); false with a Python error set.
bool bn_args(const char* name, const char* expected, PyObject* const* args, Py_ssize_t nargs,
             Py_ssize_t n_arrays, Array** arrays, std::int64_t* dims) {
  if (nargs != 11 || !fastcall::arrays(args, 0, n_arrays) ||
      !fastcall::int_args(name, expected, args, nargs, n_arrays, n_arrays + 3, dims)) {
    if (PyErr_Occurred() == nullptr) fastcall::argument_error(name, expected, args, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < n_arrays; ++i) arrays[i] = pyarray::array_of(args[i]);
  return true;
}

PyObject* batch_norm_forward_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* name = "batch_norm_forward";
  constexpr const char* expected =
      "x, w, b, y, mean, var, invstd: Array, n, c, s: int, eps: float";
  Array* a[7];
  std::int64_t d[3];
  double eps = 0.0;
  if (!bn_args(name, expected, args, nargs, 7, a, d) ||
      !fastcall::float_arg(name, expected, args, nargs, 10, &eps)) {
    return nullptr;
  }
  return fastcall::guarded(
      [&] { batch_norm_forward(*a[0], *a[1], *a[2], *a[3], *a[4], *a[5], *a[6], d[0], d[1],
                               d[2], eps); },
      pyarray::g_translate);
}

PyObject* batch_norm_backward_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* name = "batch_norm_backward";
  constexpr const char* expected = "dy, x, w, mean, invstd, dx, dw, db: Array, n, c, s: int";
  Array* a[8];
  std::int64_t d[3];
  if (!bn_args(name, expected, args, nargs, 8, a, d)) return nullptr;
  return fastcall::guarded(
      [&] { batch_norm_backward(*a[0], *a[1], *a[2], *a[3], *a[4], *a[5], *a[6], *a[7], d[0],
                                d[1], d[2]); },
      pyarray::g_translate);
}

}  // namespace

void bind_batch_norm(py::module_& m, const KernelTable* const* kernels) {
  g_bn_kernels = kernels;
  static PyMethodDef table[] = {
      fastcall::method("batch_norm_forward", batch_norm_forward_call,
                       "(x, w, b, y, mean, var, invstd, n, c, s, eps): training-mode batch "
                       "norm of x viewed as (n, c, s) (docs/backend_protocol.md)."),
      fastcall::method("batch_norm_backward", batch_norm_backward_call,
                       "(dy, x, w, mean, invstd, dx, dw, db, n, c, s): its gradients from the "
                       "saved mean and invstd."),
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(m.ptr(), table) != 0) throw py::error_already_set();
}

namespace {

// Every one of the n values an integer in [0, k), else an IndexError "<what> <i>, expected
// ..." naming the first bad one (class labels of the loss, ids of an embedding): the kernels
// index rows with them, so a bad one must be refused before they run.
template <class T>
void check_class_ids(const std::string& what, const T* values, std::size_t n, std::size_t k) {
  for (std::size_t i = 0; i < n; ++i) {
    const T v = values[i];
    if (!(v >= T(0) && v < T(k)) || v != std::floor(v)) {
      throw py::index_error(what + " " + std::to_string(i) + ", expected an integer in [0, " +
                            std::to_string(k) + "), got " +
                            std::string(py::repr(py::float_(double(v)))));
    }
  }
}

template <class T>
void check_labels(const char* op, const T* labels, std::size_t n, std::size_t k) {
  check_class_ids(std::string(op) + ": class label out of range at row", labels, n, k);
}

void xent_dims(const char* op, const Array& labels, std::int64_t n, std::int64_t k,
               std::size_t* total) {
  bn_dims(op, n, k, 1, total);
  if (k == 0 && n > 0) {
    throw std::invalid_argument(std::string(op) + ": expected at least one class, got k = 0");
  }
  check_size(op, "labels", labels, std::size_t(n));
  if (labels.dtype() == DType::f32) {
    check_labels(op, static_cast<const float*>(labels.data()), std::size_t(n), std::size_t(k));
  } else if (labels.dtype() == DType::f64) {
    check_labels(op, static_cast<const double*>(labels.data()), std::size_t(n),
                 std::size_t(k));
  }
}

}  // namespace

void bind_softmax_xent(py::module_& m, const KernelTable* const* kernels) {
  m.def("softmax_xent_forward", [kernels](const Array& z, const Array& labels, Array& loss,
                                          Array& lse, std::int64_t n, std::int64_t k) {
    const char* op = "softmax_xent_forward";
    check_float(op, z);
    for (const Array* a : {&labels, static_cast<const Array*>(&loss),
                           static_cast<const Array*>(&lse)}) {
      check_same(op, *a, z);
    }
    std::size_t total = 0;
    xent_dims(op, labels, n, k, &total);
    check_size(op, "z", z, total);
    check_size(op, "loss", loss, std::size_t(n));
    check_size(op, "lse", lse, std::size_t(n));
    check_distinct(op, loss, z, labels);
    check_distinct(op, lse, z, labels);
    if (n == 0) return;
    py::gil_scoped_release release;
    (*kernels)->xent_forward(z.dtype(), z.data(), labels.data(), loss.data(), lse.data(),
                             std::size_t(n), std::size_t(k));
  }, py::arg("z"), py::arg("labels"), py::arg("loss"), py::arg("lse"), py::arg("n"),
     py::arg("k"));
  m.def("softmax_xent_backward", [kernels](const Array& z, const Array& labels,
                                           const Array& lse, const Array& g, Array& dz,
                                           std::int64_t n, std::int64_t k) {
    const char* op = "softmax_xent_backward";
    check_float(op, z);
    for (const Array* a : {&labels, &lse, &g, static_cast<const Array*>(&dz)}) {
      check_same(op, *a, z);
    }
    std::size_t total = 0;
    xent_dims(op, labels, n, k, &total);
    check_size(op, "z", z, total);
    check_size(op, "dz", dz, total);
    check_size(op, "lse", lse, std::size_t(n));
    check_size(op, "g", g, std::size_t(n));
    check_distinct(op, dz, z, labels);
    check_distinct(op, dz, lse, g);
    if (n == 0) return;
    py::gil_scoped_release release;
    (*kernels)->xent_backward(z.dtype(), z.data(), labels.data(), lse.data(), g.data(),
                              dz.data(), std::size_t(n), std::size_t(k));
  }, py::arg("z"), py::arg("labels"), py::arg("lse"), py::arg("g"), py::arg("dz"),
     py::arg("n"), py::arg("k"));
}

// ---- embedding: rows of a table picked by ids held on the device ----------------------------
// ids are class-id floats of the table's dtype (what needle's tensors hold). Reading them here,
// not on the host, keeps a training step free of host round trips (and replayable as a kernel
// program). Every id is checked before any row is written.
namespace {

template <class T>
void check_ids(const T* ids, std::size_t n, std::size_t num) {
  check_class_ids("embedding: id out of range at position", ids, n, num);
}

template <class T>
void gather_rows(const T* table, const T* ids, T* out, std::size_t n, std::size_t dim) {
  for (std::size_t i = 0; i < n; ++i) {
    std::memcpy(out + i * dim, table + std::size_t(ids[i]) * dim, dim * sizeof(T));
  }
}

// Repeated ids add up in position order: the same sums as numpy.add.at, bit for bit.
template <class T>
void scatter_add_rows(const T* g, const T* ids, T* table, std::size_t num, std::size_t n,
                      std::size_t dim) {
  std::fill(table, table + num * dim, T(0));
  for (std::size_t i = 0; i < n; ++i) {
    T* row = table + std::size_t(ids[i]) * dim;
    const T* src = g + i * dim;
    for (std::size_t j = 0; j < dim; ++j) row[j] += src[j];
  }
}

void embedding_dims(const char* op, const Array& table, const Array& ids, const Array& rows,
                    std::int64_t num, std::int64_t dim, std::int64_t n) {
  if (num < 0 || dim < 0 || n < 0) {
    throw std::invalid_argument(std::string(op) + ": expected num, dim, n >= 0, got " +
                                std::to_string(num) + ", " + std::to_string(dim) + ", " +
                                std::to_string(n));
  }
  check_float(op, table);
  check_same(op, ids, table);
  check_same(op, rows, table);
  check_size(op, "table", table, std::size_t(num) * std::size_t(dim));
  check_size(op, "ids", ids, std::size_t(n));
  check_size(op, "rows", rows, std::size_t(n) * std::size_t(dim));
  check_distinct(op, table, ids, rows);
  check_distinct(op, rows, ids, ids);
}

template <class F>
void by_dtype(DType t, F&& f) {
  if (t == DType::f32) f(float(0));
  else f(double(0));
}

}  // namespace

void bind_embedding(py::module_& m) {
  m.def("embedding_forward", [](const Array& table, const Array& ids, Array& out,
                                std::int64_t num, std::int64_t dim, std::int64_t n) {
    embedding_dims("embedding_forward", table, ids, out, num, dim, n);
    by_dtype(table.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* id = static_cast<const T*>(ids.data());
      check_ids(id, std::size_t(n), std::size_t(num));
      py::gil_scoped_release release;
      gather_rows(static_cast<const T*>(table.data()), id, static_cast<T*>(out.data()),
                  std::size_t(n), std::size_t(dim));
    });
  }, py::arg("table"), py::arg("ids"), py::arg("out"), py::arg("num"), py::arg("dim"),
     py::arg("n"));
  m.def("embedding_backward", [](const Array& g, const Array& ids, Array& dtable,
                                 std::int64_t num, std::int64_t dim, std::int64_t n) {
    embedding_dims("embedding_backward", dtable, ids, g, num, dim, n);
    by_dtype(dtable.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const T* id = static_cast<const T*>(ids.data());
      check_ids(id, std::size_t(n), std::size_t(num));
      py::gil_scoped_release release;
      scatter_add_rows(static_cast<const T*>(g.data()), id, static_cast<T*>(dtable.data()),
                       std::size_t(num), std::size_t(n), std::size_t(dim));
    });
  }, py::arg("g"), py::arg("ids"), py::arg("dtable"), py::arg("num"), py::arg("dim"),
     py::arg("n"));
}

}  // namespace needle
