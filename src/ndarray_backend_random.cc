// mt19937_uniform: np.random.rand's draws made by a kernel, straight into a needle buffer
// (mt19937_impl.h has the algorithm and why). The entry point checks everything that could
// corrupt memory: the generator must be NumPy's MT19937 (whose state layout the kernel
// assumes), its position in range, the buffer large enough; it holds the generator's lock
// while drawing, as NumPy's own draws do.
#include "ndarray_backend_random.h"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "array.h"
#include "release_gil.h"

namespace py = pybind11;

namespace needle {
namespace {

// NumPy's bitgen_t (numpy/random/bitgen.h) begins with the generator's state pointer; the
// "BitGenerator" capsule of a bit generator holds a bitgen_t*.
struct NumpyBitGen {
  void* state;
};

// numpy.random.MT19937, looked up once (and kept for the life of the process).
PyObject* mt19937_type() {
  static PyObject* type =
      py::object(py::module_::import("numpy.random").attr("MT19937")).release().ptr();
  return type;
}

// Holds bit_generator.lock for its lifetime (acquire() and release(), as `with lock:` does).
class GeneratorLock {
 public:
  explicit GeneratorLock(const py::handle& bit_generator) : lock_(bit_generator.attr("lock")) {
    lock_.attr("acquire")();
  }
  ~GeneratorLock() {
    try {
      lock_.attr("release")();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("mt19937_uniform: releasing the generator lock");
    }
  }
  GeneratorLock(const GeneratorLock&) = delete;
  GeneratorLock& operator=(const GeneratorLock&) = delete;

 private:
  py::object lock_;
};

Mt19937State* mt19937_state(const py::handle& bit_generator) {
  const char* op = "mt19937_uniform";
  if (Py_TYPE(bit_generator.ptr()) != reinterpret_cast<PyTypeObject*>(mt19937_type())) {
    throw py::type_error(std::string(op) + ": expected a numpy.random.MT19937, got " +
                         std::string(py::str(py::type::handle_of(bit_generator).attr("__name__"))));
  }
  py::object capsule = bit_generator.attr("capsule");
  auto* bitgen = static_cast<NumpyBitGen*>(PyCapsule_GetPointer(capsule.ptr(), "BitGenerator"));
  if (bitgen == nullptr) throw py::error_already_set();
  return static_cast<Mt19937State*>(bitgen->state);  // an MT19937's: its layout is known
}

}  // namespace

void bind_random(py::module_& m, const KernelTable* const* kernels) {
  m.def("mt19937_uniform", [kernels](const py::handle& bit_generator, Array& out,
                                     std::int64_t n, py::object p) {
    const char* op = "mt19937_uniform";
    if (out.dtype() != DType::f32 && out.dtype() != DType::f64) {
      throw py::type_error(std::string(op) + ": expected a float32 or float64 out, got " +
                           dtype_name(out.dtype()));
    }
    if (n < 0 || std::uint64_t(n) > out.size()) {
      throw std::invalid_argument(std::string(op) + ": expected 0 <= n <= out.size (" +
                                  std::to_string(out.size()) + "), got " + std::to_string(n));
    }
    const bool below = !p.is_none();
    const double threshold = below ? p.cast<double>() : 0.0;
    Mt19937State* state = mt19937_state(bit_generator);
    GeneratorLock lock(bit_generator);
    const int pos = state->pos;
    if (pos < 0 || pos > kMt19937Words) {
      throw std::invalid_argument(std::string(op) + ": generator position out of range, " +
                                  "expected 0..624, got " + std::to_string(pos));
    }
    if (n == 0) return;
    ReleaseGilIfLarge release{double(n)};
    (*kernels)->uniform_fill(state, out.dtype(), out.data(), std::size_t(n), below, threshold);
  }, py::arg("bit_generator"), py::arg("out"), py::arg("n"), py::arg("p") = py::none(),
     "Fill out[:n] with the next n draws of np.random.rand from `bit_generator` (NumPy's "
     "MT19937, advanced in place), or with 1/0 where draw <= p when p is given.");
}

}  // namespace needle
