// When a C++ entry point lets other Python threads run while its kernel works.
#pragma once

#include <Python.h>

namespace needle {

// Small kernels keep the GIL: releasing and taking it back costs about as much as adding a few
// thousand floats, and no other thread can use a gap that short. Larger ones release it, so
// that a communication thread progresses while compute runs.
// `work`: elements touched, or multiply-adds for a matmul (a double: m * n * p cannot wrap).
constexpr double kReleaseGilWork = 32768.0;

class ReleaseGilIfLarge {
 public:
  explicit ReleaseGilIfLarge(double work)
      : state_(work >= kReleaseGilWork ? PyEval_SaveThread() : nullptr) {}
  ~ReleaseGilIfLarge() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  ReleaseGilIfLarge(const ReleaseGilIfLarge&) = delete;
  ReleaseGilIfLarge& operator=(const ReleaseGilIfLarge&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace needle
