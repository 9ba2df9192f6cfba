// The hottest entry points (new_array, fill, view copies, the elementwise kernels, reductions
// and matmul) bound with the C API's fast-call convention instead of pybind11's dispatcher.
//
// Why: small models run one of these per NDArray op. pybind11's dispatcher (argument vector,
// overload loop, casters) cost ~0.27 µs per call on the project's VM, a trivial call through
// this path ~0.05 µs. The functions keep their names, positional signatures and checks
// (binary, scalar and unary above do the checking); bad arguments raise TypeError naming the
// function, the expected and the actual argument types.
//
// Included by ndarray_backend_cpu.cc only, inside its anonymous namespace, after the entry
// points it calls (binary, add_rows, scalar, unary, reduce, sum_leading, matmul,
// matmul_strided) and translate_check_errors.
#pragma once
// No includes here (see above): the includer brings pybind11, fast_call_args.h and kernels.h.

namespace fast {

using fastcall::argument_error;
using fastcall::arrays;
using fastcall::dims_arg;
using fastcall::float_arg;
using fastcall::int_args;
using pyarray::array_of;
using pyarray::is_array;

// Runs `call` (an entry point above); None, or the Python error for what it threw.
template <class Call>
PyObject* guarded(Call&& call) {
  return fastcall::guarded(call, &translate_check_errors);
}

inline PyObject* new_array(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyLong_Check(args[0])) {
    return argument_error("new_array", "size: int, dtype", args, nargs);
  }
  const long long size = PyLong_AsLongLong(args[0]);
  if (size == -1 && PyErr_Occurred()) return nullptr;
  try {
    const DType t = pyarray::dtype_of(args[1]);
    return pyarray::adopt(new Array(size, t, pyalloc::creation_category(py::none())));
  } catch (...) {
    pyarray::set_python_error(&translate_check_errors);
    return nullptr;
  }
}

struct BinaryEntry {
  const char* name;
  BinOp op;
};
constexpr BinaryEntry kBinary[] = {
    {"ewise_add", BinOp::add},         {"ewise_sub", BinOp::sub},
    {"ewise_mul", BinOp::mul},         {"ewise_div", BinOp::div},
    {"ewise_maximum", BinOp::maximum}, {"ewise_minimum", BinOp::minimum},
    {"ewise_power", BinOp::power},     {"ewise_eq", BinOp::eq},
    {"ewise_ge", BinOp::ge},           {"ewise_tanh_grad", BinOp::tanh_grad},
    {"ewise_relu_grad", BinOp::relu_grad}};

template <int I>
PyObject* binary_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr BinaryEntry e = kBinary[I];
  if (nargs != 3 || !arrays(args, 0, 3)) {
    return argument_error(e.name, "a: Array, b: Array, out: Array", args, nargs);
  }
  return guarded(
      [&] { binary(e.op, e.name, *array_of(args[0]), *array_of(args[1]), *array_of(args[2])); });
}

// The arguments of an entry point taking `n_arrays` Arrays and then two ints (m, n), the
// ints into dims; false with the Python error set.
inline bool arrays_and_dims(const char* name, const char* expected, PyObject* const* args,
                            Py_ssize_t nargs, Py_ssize_t n_arrays, std::int64_t* dims) {
  if (nargs != n_arrays + 2 || !arrays(args, 0, n_arrays)) {
    argument_error(name, expected, args, nargs);
    return false;
  }
  return int_args(name, expected, args, nargs, n_arrays, n_arrays + 2, dims);
}

inline PyObject* add_rows_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  std::int64_t v[2];
  if (!arrays_and_dims("ewise_add_rows", "a: Array, row: Array, out: Array, m, n: int", args,
                       nargs, 3, v)) {
    return nullptr;
  }
  return guarded(
      [&] { add_rows(*array_of(args[0]), *array_of(args[1]), *array_of(args[2]), v[0], v[1]); });
}

struct ScalarEntry {
  const char* name;
  BinOp op;
  bool reversed;  // val (op) a instead of a (op) val
};
constexpr ScalarEntry kScalar[] = {
    {"scalar_add", BinOp::add, false},         {"scalar_sub", BinOp::sub, false},
    {"scalar_rsub", BinOp::sub, true},         {"scalar_mul", BinOp::mul, false},
    {"scalar_div", BinOp::div, false},         {"scalar_rdiv", BinOp::div, true},
    {"scalar_power", BinOp::power, false},     {"scalar_rpower", BinOp::power, true},
    {"scalar_maximum", BinOp::maximum, false}, {"scalar_minimum", BinOp::minimum, false},
    {"scalar_eq", BinOp::eq, false},           {"scalar_ge", BinOp::ge, false},
    {"scalar_le", BinOp::ge, true}};  // a <= val  is  val >= a

template <int I>
PyObject* scalar_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr ScalarEntry e = kScalar[I];
  if (nargs != 3 || !is_array(args[0]) || !is_array(args[2])) {
    return argument_error(e.name, "a: Array, val: float, out: Array", args, nargs);
  }
  double val = 0.0;
  if (!float_arg(e.name, "a: Array, val: float, out: Array", args, nargs, 1, &val)) {
    return nullptr;
  }
  return guarded(
      [&] { scalar(e.op, e.reversed, e.name, *array_of(args[0]), val, *array_of(args[2])); });
}

struct UnaryEntry {
  const char* name;
  UnOp op;
};
constexpr UnaryEntry kUnary[] = {
    {"ewise_neg", UnOp::neg},   {"ewise_log", UnOp::log},   {"ewise_exp", UnOp::exp},
    {"ewise_tanh", UnOp::tanh}, {"ewise_sqrt", UnOp::sqrt}, {"ewise_abs", UnOp::abs},
    {"ewise_sign", UnOp::sign}, {"ewise_sigmoid", UnOp::sigmoid}};

template <int I>
PyObject* unary_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr UnaryEntry e = kUnary[I];
  if (nargs != 2 || !arrays(args, 0, 2)) {
    return argument_error(e.name, "a: Array, out: Array", args, nargs);
  }
  return guarded([&] { unary(e.op, e.name, *array_of(args[0]), *array_of(args[1])); });
}


// Every matmul backward multiplies by a transposed view: this is the op's hot entry point.
inline PyObject* matmul_strided_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* name = "matmul_strided";
  constexpr const char* expected =
      "a: Array, b: Array, out: Array, m, n, p, a_offset, ars, acs, b_offset, brs, bcs: int";
  std::int64_t v[9];
  if (nargs != 12 || !arrays(args, 0, 3)) return argument_error(name, expected, args, nargs);
  if (!int_args(name, expected, args, nargs, 3, 12, v)) return nullptr;
  return guarded([&] {
    matmul_strided(*array_of(args[0]), *array_of(args[1]), *array_of(args[2]), v[0], v[1],
                   v[2], v[3], v[4], v[5], v[6], v[7], v[8]);
  });
}

inline PyObject* matmul_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* expected = "a: Array, b: Array, out: Array, m, n, p: int";
  std::int64_t v[3];
  if (nargs != 6 || !arrays(args, 0, 3)) return argument_error("matmul", expected, args, nargs);
  if (!int_args("matmul", expected, args, nargs, 3, 6, v)) return nullptr;
  return guarded([&] {
    matmul(*array_of(args[0]), *array_of(args[1]), *array_of(args[2]), v[0], v[1], v[2]);
  });
}

struct ReduceEntry {
  const char* name;
  RedOp op;
};
constexpr ReduceEntry kReduce[] = {
    {"reduce_sum", RedOp::sum}, {"reduce_max", RedOp::max}, {"reduce_min", RedOp::min}};

template <int I>
PyObject* reduce_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr ReduceEntry e = kReduce[I];
  constexpr const char* expected = "a: Array, out: Array, reduce_size: int";
  std::int64_t size = 0;
  if (nargs != 3 || !arrays(args, 0, 2)) return argument_error(e.name, expected, args, nargs);
  if (!int_args(e.name, expected, args, nargs, 2, 3, &size)) return nullptr;
  return guarded([&] { reduce(e.op, e.name, *array_of(args[0]), *array_of(args[1]), size); });
}

inline PyObject* sum_leading_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  std::int64_t v[2];
  if (!arrays_and_dims("reduce_sum_leading", "a: Array, out: Array, m, n: int", args, nargs,
                       2, v)) {
    return nullptr;
  }
  return guarded([&] { sum_leading(*array_of(args[0]), *array_of(args[1]), v[0], v[1]); });
}

// compact(a, out, shape, strides, offset) and ewise_setitem(a, out, shape, strides, offset):
// a strided view gathered into a compact array, or a compact array scattered into a view.
template <bool Scatter>
PyObject* view_copy_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* name = Scatter ? "ewise_setitem" : "compact";
  constexpr const char* expected =
      "a: Array, out: Array, shape: tuple, strides: tuple, offset: int";
  Dims shape, strides;
  std::int64_t offset = 0;
  if (nargs != 5 || !arrays(args, 0, 2)) return argument_error(name, expected, args, nargs);
  if (!dims_arg(name, expected, args, nargs, 2, &shape) ||
      !dims_arg(name, expected, args, nargs, 3, &strides) ||
      !int_args(name, expected, args, nargs, 4, 5, &offset)) {
    return nullptr;
  }
  return guarded([&] {
    auto* copy = Scatter ? &ewise_setitem : &compact;
    copy(*array_of(args[0]), *array_of(args[1]), std::move(shape), std::move(strides), offset);
  });
}

inline PyObject* scalar_setitem_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* name = "scalar_setitem";
  constexpr const char* expected =
      "size: int, val: float, out: Array, shape: tuple, strides: tuple, offset: int";
  Dims shape, strides;
  std::int64_t size = 0, offset = 0;
  if (nargs != 6 || !is_array(args[2])) return argument_error(name, expected, args, nargs);
  double val = 0.0;
  if (!float_arg(name, expected, args, nargs, 1, &val) ||
      !int_args(name, expected, args, nargs, 0, 1, &size) ||
      !dims_arg(name, expected, args, nargs, 3, &shape) ||
      !dims_arg(name, expected, args, nargs, 4, &strides) ||
      !int_args(name, expected, args, nargs, 5, 6, &offset)) {
    return nullptr;
  }
  return guarded([&] {
    scalar_setitem(size, val, *array_of(args[2]), std::move(shape), std::move(strides), offset);
  });
}

inline PyObject* fill_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* expected = "out: Array, val: float";
  if (nargs != 2 || !is_array(args[0])) return argument_error("fill", expected, args, nargs);
  double val = 0.0;
  if (!float_arg("fill", expected, args, nargs, 1, &val)) return nullptr;
  return guarded([&] { fill(*array_of(args[0]), val); });
}

template <class Entries, std::size_t N>
constexpr std::size_t count(const Entries (&)[N]) {
  return N;
}

// One method table for all of them (PyModule_AddFunctions keeps pointers into it).
template <std::size_t... B, std::size_t... S, std::size_t... U, std::size_t... R>
PyMethodDef* method_table(std::index_sequence<B...>, std::index_sequence<S...>,
                          std::index_sequence<U...>, std::index_sequence<R...>) {
  using fastcall::method;
  static PyMethodDef table[] = {
      method("new_array", new_array,
             "new_array(size, dtype): a new Array of `size` uninitialised elements, as "
             "Array(size, dtype)."),
      method(kBinary[B].name, binary_call<int(B)>,
             "(a, b, out): out = a (op) b elementwise over out.size elements.")...,
      method(kScalar[S].name, scalar_call<int(S)>,
             "(a, val, out): out = a (op) val elementwise over out.size elements.")...,
      method(kUnary[U].name, unary_call<int(U)>,
             "(a, out): out = op(a) elementwise over out.size elements.")...,
      method(kReduce[R].name, reduce_call<int(R)>,
             "(a, out, reduce_size): out[i] = op over a[i * reduce_size : (i + 1) * "
             "reduce_size].")...,
      method("reduce_sum_leading", sum_leading_call,
             "(a, out, m, n): out (n elements) = the m rows of a (m x n) added up."),
      method("ewise_add_rows", add_rows_call,
             "(a, row, out, m, n): out (m x n) = a (m x n) + row (n elements) added to every "
             "row; out may be a."),
      method("fill", fill_call, "(out, val): every element of out set to val."),
      method("compact", view_copy_call<false>,
             "(a, out, shape, strides, offset): the view of a (element strides and offset) "
             "copied into compact out."),
      method("ewise_setitem", view_copy_call<true>,
             "(a, out, shape, strides, offset): compact a written into the view of out."),
      method("scalar_setitem", scalar_setitem_call,
             "(size, val, out, shape, strides, offset): every element of the view of out set "
             "to val; size must equal the view's element count."),
      method("matmul", matmul_call,
             "(a, b, out, m, n, p): out (m x p) = a (m x n) @ b (n x p), all compact "
             "row-major."),
      method("matmul_strided", matmul_strided_call,
             "(a, b, out, m, n, p, a_offset, ars, acs, b_offset, brs, bcs): out = A @ B read "
             "through element offsets and (row, column) strides >= 0; out compact."),
      {nullptr, nullptr, 0, nullptr}};
  return table;
}

inline void bind(py::module_& m) {
  PyMethodDef* table = method_table(std::make_index_sequence<count(kBinary)>(),
                                    std::make_index_sequence<count(kScalar)>(),
                                    std::make_index_sequence<count(kUnary)>(),
                                    std::make_index_sequence<count(kReduce)>());
  if (PyModule_AddFunctions(m.ptr(), table) != 0) throw py::error_already_set();
}

}  // namespace fast
