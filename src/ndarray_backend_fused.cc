// Entry points of the fused kernels (docs/backend_protocol.md, "Fused kernels"). Like the other
// entry points they check what would otherwise crash the process (dtypes, sizes, geometry,
// aliasing), release the GIL and run the kernel of the current table.
#include "ndarray_backend_fused.h"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "array.h"

namespace py = pybind11;

namespace needle {
namespace {

void check_float(const char* op, const Array& a) {
  if (a.dtype() == DType::f16) {
    throw std::invalid_argument(std::string(op) + ": expected float32 or float64, got float16");
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

void check_distinct(const char* op, const Array& out, const Array& a, const Array& b) {
  if (out.data() == a.data() || out.data() == b.data()) {
    throw std::invalid_argument(std::string(op) + ": out must not share memory with an input");
  }
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
  return g;
}

#define NEEDLE_GEOM_ARGS                                                                     \
  std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c, std::int64_t kh,           \
      std::int64_t kw, std::int64_t cout, std::int64_t stride, std::int64_t pad
#define NEEDLE_GEOM_VALUES n, h, w, c, kh, kw, cout, stride, pad

}  // namespace

void bind_lstm(py::module_& m, const KernelTable* const* kernels);

void bind_fused(py::module_& m, const KernelTable* const* kernels) {
  bind_lstm(m, kernels);
  m.def("conv2d_forward", [kernels](const Array& x, const Array& wt, Array& out,
                                    NEEDLE_GEOM_ARGS) {
    const char* op = "conv2d_forward";
    const ConvGeom g = make_geom(op, NEEDLE_GEOM_VALUES);
    check_float(op, out);
    check_same(op, x, out);
    check_same(op, wt, out);
    check_size(op, "x", x, g.n * g.h * g.w * g.c);
    check_size(op, "w", wt, g.k() * g.cout);
    check_size(op, "out", out, g.pixels() * g.cout);
    check_distinct(op, out, x, wt);
    py::gil_scoped_release release;
    (*kernels)->conv_forward(out.dtype(), x.data(), wt.data(), out.data(), g);
  });
  m.def("conv2d_weight_grad", [kernels](const Array& x, const Array& dy, Array& dw,
                                        NEEDLE_GEOM_ARGS) {
    const char* op = "conv2d_weight_grad";
    const ConvGeom g = make_geom(op, NEEDLE_GEOM_VALUES);
    check_float(op, dw);
    check_same(op, x, dw);
    check_same(op, dy, dw);
    check_size(op, "x", x, g.n * g.h * g.w * g.c);
    check_size(op, "dy", dy, g.pixels() * g.cout);
    check_size(op, "dw", dw, g.k() * g.cout);
    check_distinct(op, dw, x, dy);
    py::gil_scoped_release release;
    (*kernels)->conv_weight_grad(dw.dtype(), x.data(), dy.data(), dw.data(), g);
  });
  m.def("conv2d_input_grad", [kernels](const Array& dy, const Array& wt, Array& dx,
                                       NEEDLE_GEOM_ARGS) {
    const char* op = "conv2d_input_grad";
    const ConvGeom g = make_geom(op, NEEDLE_GEOM_VALUES);
    check_float(op, dx);
    check_same(op, dy, dx);
    check_same(op, wt, dx);
    check_size(op, "dy", dy, g.pixels() * g.cout);
    check_size(op, "w", wt, g.k() * g.cout);
    check_size(op, "dx", dx, g.n * g.h * g.w * g.c);
    check_distinct(op, dx, dy, wt);
    py::gil_scoped_release release;
    (*kernels)->conv_input_grad(dx.dtype(), dy.data(), wt.data(), dx.data(), g);
  });
}


void bind_lstm(py::module_& m, const KernelTable* const* kernels) {
  m.def("lstm_cell_forward", [kernels](const Array& z, const Array* bias, const Array& c,
                                       Array& h_out, Array& c_out, Array& gates_out,
                                       Array& tanh_c_out, std::int64_t batch,
                                       std::int64_t hidden) {
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
    py::gil_scoped_release release;
    (*kernels)->lstm_forward(z.dtype(), z.data(), bias_data, c.data(), h_out.data(),
                             c_out.data(), gates_out.data(), tanh_c_out.data(), rows, h);
  }, py::arg("z"), py::arg("bias").none(true), py::arg("c"), py::arg("h_out"),
     py::arg("c_out"), py::arg("gates_out"), py::arg("tanh_c_out"), py::arg("batch"),
     py::arg("hidden"));
  m.def("lstm_cell_backward", [kernels](const Array& gates, const Array& tanh_c,
                                        const Array& c, const Array& dh, const Array& dc,
                                        Array& dz_out, Array& dc_prev_out, std::int64_t batch,
                                        std::int64_t hidden) {
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
    py::gil_scoped_release release;
    (*kernels)->lstm_backward(gates.dtype(), gates.data(), tanh_c.data(), c.data(), dh.data(),
                              dc.data(), dz_out.data(), dc_prev_out.data(), rows, h);
  });
}

}  // namespace needle
