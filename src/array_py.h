// The backend's Array as a Python type written against the C API, and pybind11's caster for it.
//
// Why not py::class_<Array>: every NDArray op allocates one output Array, and pybind11's
// instance machinery (holder construction, an insert into and an erase from its registry of
// live instances, a dispatcher call) cost 0.68 µs per allocation on the project's VM, as much
// as a small op's kernel. This type is a plain CPython object holding an Array*; pybind11
// functions still take `const Array&`, `Array*` or lists of them through the caster below, so
// every binding reads Arrays the way it did. Functions returning `Array*` hand over ownership.
//
// Included by every translation unit that binds functions with Array arguments (the caster
// must be the same everywhere); the type object is created once, by init_array_type().
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "allocator_py.h"
#include "array.h"

namespace needle {
namespace pyarray {

namespace py = pybind11;

struct ArrayObject {
  PyObject_HEAD
  Array* array;
  PyObject* weakrefs;  // in-place write logs hold weak references to buffers
};

inline PyTypeObject* g_type = nullptr;  // set once by init_array_type; never freed

inline bool is_array(PyObject* o) { return Py_TYPE(o) == g_type; }
inline Array* array_of(PyObject* o) { return reinterpret_cast<ArrayObject*>(o)->array; }

// The Array held by `o`, nullptr for None; a TypeError naming `op` for anything else.
inline Array* array_or_null(py::handle o, const char* op) {
  if (o.is_none()) return nullptr;
  if (!is_array(o.ptr())) {
    throw py::type_error(std::string(op) + ": expected an Array, got " +
                         Py_TYPE(o.ptr())->tp_name);
  }
  return array_of(o.ptr());
}

// A new Python Array owning `owned` (deleted here if the object cannot be made).
inline PyObject* adopt(Array* owned) {
  PyObject* obj = g_type->tp_alloc(g_type, 0);
  if (obj == nullptr) {
    delete owned;
    throw py::error_already_set();
  }
  reinterpret_cast<ArrayObject*>(obj)->array = owned;
  return obj;
}

// One interned str per dtype, indexed by DType (leaked on purpose: no GIL at exit). Read on
// every NDArray op (dtype checks) and matched by pointer on every allocation.
inline PyObject* const* dtype_names() {
  static PyObject* const names[4] = {PyUnicode_InternFromString(dtype_name(DType::f32)),
                                     PyUnicode_InternFromString(dtype_name(DType::f64)),
                                     PyUnicode_InternFromString(dtype_name(DType::f16)),
                                     PyUnicode_InternFromString(dtype_name(DType::bf16))};
  return names;
}

// The dtype named by a str (interned names matched by pointer) or anything np.dtype accepts.
inline DType dtype_of(PyObject* dtype) {
  PyObject* const* names = dtype_names();
  if (dtype == names[0]) return DType::f32;
  if (dtype == names[1]) return DType::f64;
  if (dtype == names[2]) return DType::f16;
  if (dtype == names[3]) return DType::bf16;
  py::handle h(dtype);
  if (py::isinstance<py::str>(h)) return parse_dtype(h.cast<std::string>());
  return parse_dtype(py::str(py::dtype::from_args(py::reinterpret_borrow<py::object>(h))
                                 .attr("name")));
}

// The Python error for the C++ exception being handled; call inside `catch (...)`.
// `extra` (may be null) translates the module's own exception types first.
inline void set_python_error(void (*extra)(std::exception_ptr)) noexcept {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const LimitExceeded& e) {
    pyalloc::raise_limit_exceeded(e);
  } catch (...) {
    const std::exception_ptr p = std::current_exception();
    if (extra != nullptr) {
      try {
        extra(p);
      } catch (...) {
      }
    }
    if (PyErr_Occurred() == nullptr) py::detail::translate_exception(p);
  }
}

inline void (*g_translate)(std::exception_ptr) = nullptr;  // the module's own translator

// ---- the type's slots ------------------------------------------------------------------------
inline PyObject* array_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"size", "dtype", "category", nullptr};
  long long size = 0;
  PyObject* dtype = nullptr;
  PyObject* category = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "L|OO:Array", const_cast<char**>(keywords),
                                   &size, &dtype, &category)) {
    return nullptr;
  }
  try {
    const DType t = dtype == nullptr ? DType::f32 : dtype_of(dtype);
    const Category c = pyalloc::creation_category(py::reinterpret_borrow<py::object>(category));
    return adopt(new Array(size, t, c));
  } catch (...) {
    set_python_error(g_translate);
    return nullptr;
  }
}

inline void array_dealloc(PyObject* self) {
  auto* o = reinterpret_cast<ArrayObject*>(self);
  if (o->weakrefs != nullptr) PyObject_ClearWeakRefs(self);
  delete o->array;
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);  // instances of a heap type hold a reference to it
}

inline PyObject* array_repr(PyObject* self) {
  const Array& a = *array_of(self);
  const std::string s = "Array(size=" + std::to_string(a.size()) + ", dtype='" +
                        dtype_name(a.dtype()) + "')";
  return PyUnicode_FromString(s.c_str());
}

inline PyObject* get_size(PyObject* self, void*) {
  return PyLong_FromSize_t(array_of(self)->size());
}

inline PyObject* get_dtype(PyObject* self, void*) {
  PyObject* name = dtype_names()[int(array_of(self)->dtype())];
  Py_INCREF(name);
  return name;
}

inline PyObject* get_itemsize(PyObject* self, void*) {
  return PyLong_FromSize_t(itemsize(array_of(self)->dtype()));
}

inline PyObject* get_category(PyObject* self, void*) {
  return PyUnicode_FromString(category_name(mem::block_category(array_of(self)->block())));
}

inline int set_category(PyObject* self, PyObject* value, void*) {
  if (value == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "Array.category: cannot delete the category");
    return -1;
  }
  try {
    mem::retag(array_of(self)->block(), pyalloc::to_category(value, "category"));
    return 0;
  } catch (...) {
    set_python_error(g_translate);
    return -1;
  }
}

inline PyObject* get_block_id(PyObject* self, void*) {
  return PyLong_FromUnsignedLongLong(mem::block_id(array_of(self)->block()));
}

inline PyObject* array_ptr(PyObject* self, PyObject*) {
  return PyLong_FromVoidPtr(array_of(self)->data());
}

// Creates the type and adds it to `m` as `Array`.
inline void init_array_type(py::module_& m, void (*translate)(std::exception_ptr)) {
  g_translate = translate;
  static PyGetSetDef getset[] = {
      {"size", get_size, nullptr, "Number of elements.", nullptr},
      {"dtype", get_dtype, nullptr,
       "Element type name ('float32', 'float64', 'float16', 'bfloat16').", nullptr},
      {"itemsize", get_itemsize, nullptr, "Bytes per element.", nullptr},
      {"category", get_category, set_category,
       "Memory category the buffer is charged to; assigning moves its bytes (a retag).",
       nullptr},
      {"block_id", get_block_id, nullptr, "Allocator block id (the `block` field of events).",
       nullptr},
      {nullptr, nullptr, nullptr, nullptr, nullptr}};
  static PyMethodDef methods[] = {
      {"ptr", array_ptr, METH_NOARGS, "Address of the first element."},
      {nullptr, nullptr, 0, nullptr}};
  static PyMemberDef members[] = {
      {"__weaklistoffset__", T_PYSSIZET, offsetof(ArrayObject, weakrefs), READONLY, nullptr},
      {nullptr, 0, 0, 0, nullptr}};
  static PyType_Slot slots[] = {
      {Py_tp_new, reinterpret_cast<void*>(array_new)},
      {Py_tp_dealloc, reinterpret_cast<void*>(array_dealloc)},
      {Py_tp_repr, reinterpret_cast<void*>(array_repr)},
      {Py_tp_getset, getset},
      {Py_tp_methods, methods},
      {Py_tp_members, members},
      {Py_tp_doc, const_cast<char*>(
           "Array(size, dtype='float32', category=None): a flat buffer of `size` uninitialised "
           "elements from the caching allocator, charged to a memory category.")},
      {0, nullptr}};
  static PyType_Spec spec = {"needle.backend_ndarray.ndarray_backend_cpu.Array",
                             int(sizeof(ArrayObject)), 0, Py_TPFLAGS_DEFAULT, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (type == nullptr) throw py::error_already_set();
  g_type = reinterpret_cast<PyTypeObject*>(type);  // the module and g_type share this reference
  m.add_object("Array", py::reinterpret_borrow<py::object>(type));
}

}  // namespace pyarray
}  // namespace needle

namespace pybind11 {
namespace detail {

// Arguments `const Array&`, `Array&`, `Array*` (None gives nullptr, as pybind11 does for
// pointers) and lists of them; results `Array*`, whose ownership passes to Python.
template <>
class type_caster<needle::Array> {
 public:
  static constexpr auto name = const_name("Array");

  bool load(handle src, bool convert) {
    if (src.is_none()) {
      value_ = nullptr;
      return convert;
    }
    if (!needle::pyarray::is_array(src.ptr())) return false;
    value_ = needle::pyarray::array_of(src.ptr());
    return true;
  }

  static handle cast(needle::Array* src, return_value_policy policy, handle) {
    if (src == nullptr) return none().release();
    if (policy != return_value_policy::take_ownership &&
        policy != return_value_policy::automatic) {
      throw cast_error("Array: only ownership can pass to Python (take_ownership)");
    }
    return needle::pyarray::adopt(src);
  }

  template <typename T>
  using cast_op_type = detail::cast_op_type<T>;

  operator needle::Array*() { return value_; }
  operator needle::Array&() {
    if (value_ == nullptr) throw reference_cast_error();
    return *value_;
  }

 private:
  needle::Array* value_ = nullptr;
};

}  // namespace detail
}  // namespace pybind11
