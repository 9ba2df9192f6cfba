// Argument parsing for entry points bound with the C API's fast-call convention
// (fast_calls_py.h, ndarray_backend_program.cc): positional arguments checked one by one, and
// a TypeError naming the function, the arguments it expected and the types it got.
#pragma once

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include "array_py.h"
#include "strided.h"

namespace needle {
namespace fastcall {

// A method table entry for a fast-call function (PyModule_AddFunctions keeps the table).
using FastFunction = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t);
inline PyMethodDef method(const char* name, FastFunction fn, const char* doc) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)), METH_FASTCALL,
          doc};
}

// "ewise_add: expected arguments (a: Array, b: Array, out: Array), got (Array, float)"
inline PyObject* argument_error(const char* name, const char* expected, PyObject* const* args,
                                Py_ssize_t nargs) {
  std::string got;
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (i) got += ", ";
    const char* type = Py_TYPE(args[i])->tp_name;  // without its module, as type().__name__
    const char* dot = std::strrchr(type, '.');
    got += dot != nullptr ? dot + 1 : type;
  }
  PyErr_Format(PyExc_TypeError, "%s: expected arguments (%s), got (%s)", name, expected,
               got.c_str());
  return nullptr;
}

inline bool arrays(PyObject* const* args, Py_ssize_t from, Py_ssize_t to) {
  for (Py_ssize_t i = from; i < to; ++i) {
    if (!pyarray::is_array(args[i])) return false;
  }
  return true;
}

// Runs `call`; None, or the Python error for what it threw (`translate`: the module's own
// exception types, may be null).
template <class Call>
PyObject* guarded(Call&& call, void (*translate)(std::exception_ptr)) {
  try {
    call();
  } catch (...) {
    pyarray::set_python_error(translate);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// A float argument (floats, ints and anything with __float__) into *out; false with a Python
// error set otherwise (an int too large for a double keeps its OverflowError).
inline bool float_arg(const char* name, const char* expected, PyObject* const* args,
                      Py_ssize_t nargs, Py_ssize_t at, double* out) {
  *out = PyFloat_AsDouble(args[at]);
  if (*out == -1.0 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      argument_error(name, expected, args, nargs);
    }
    return false;
  }
  return true;
}

// `item` as an int (ints and anything with __index__) into *out; false with a Python error set
// otherwise: the argument error for a non-int, an OverflowError kept.
inline bool int_value(const char* name, const char* expected, PyObject* const* args,
                      Py_ssize_t nargs, PyObject* item, std::int64_t* out) {
  const long long v = PyLong_AsLongLong(item);
  if (v == -1 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      argument_error(name, expected, args, nargs);
    }
    return false;
  }
  *out = v;
  return true;
}

// Integer arguments args[from, to) into out; false (a Python error set) when one is not an int.
inline bool int_args(const char* name, const char* expected, PyObject* const* args,
                     Py_ssize_t nargs, Py_ssize_t from, Py_ssize_t to, std::int64_t* out) {
  for (Py_ssize_t i = from; i < to; ++i) {
    if (!int_value(name, expected, args, nargs, args[i], &out[i - from])) return false;
  }
  return true;
}

// The items of `seq` into *items and *n when it is a list or tuple; false (no error set)
// otherwise.
inline bool sequence_items(PyObject* seq, PyObject*** items, Py_ssize_t* n) {
  if (!PyTuple_Check(seq) && !PyList_Check(seq)) return false;
  *n = PySequence_Fast_GET_SIZE(seq);
  *items = PySequence_Fast_ITEMS(seq);
  return true;
}

// The items of a list or tuple argument args[at] into *items and *n; false with a TypeError
// naming the function when it is neither.
inline bool sequence_arg(const char* name, const char* expected, PyObject* const* args,
                         Py_ssize_t nargs, Py_ssize_t at, PyObject*** items, Py_ssize_t* n) {
  if (sequence_items(args[at], items, n)) return true;
  argument_error(name, expected, args, nargs);
  return false;
}

// A shape or strides argument: a tuple or list of ints.
inline bool dims_arg(const char* name, const char* expected, PyObject* const* args,
                     Py_ssize_t nargs, Py_ssize_t at, Dims* out) {
  PyObject** items = nullptr;
  Py_ssize_t n = 0;
  if (!sequence_arg(name, expected, args, nargs, at, &items, &n)) return false;
  out->resize(std::size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!int_value(name, expected, args, nargs, items[i], &(*out)[std::size_t(i)])) return false;
  }
  return true;
}

}  // namespace fastcall
}  // namespace needle
