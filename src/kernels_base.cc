// Baseline x86-64 (or any other architecture) build of the kernels.
#define NEEDLE_ISA base
#define NEEDLE_ISA_NAME "baseline"
#include "kernels_impl.h"
