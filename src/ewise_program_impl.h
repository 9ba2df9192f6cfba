// A chain of elementwise kernels run as one pass: the fused kernel of needle.compile's kernel
// programs (needle/compiler/fusion.py). Included by kernels_impl.h after elementwise_impl.h,
// so each instruction set has its own copy and every step uses the very loops the separate
// kernels use (bin_loop_plain, scalar_loop_plain, un_loop_plain): the results are bitwise
// those of the unfused chain, only the intermediates never leave a block of registers in L1.
//
// The program is a list of instructions of five int32s {kind, op, dst, a, b} over up to
// kProgramRegisters registers, each a block of kProgramBlock elements:
//   kLoad    dst <- input a            kStore  output dst <- register a
//   kBinary  dst <- op(a, b)           kScalar dst <- op(a, scalars[b])
//   kRScalar dst <- op(scalars[b], a)  kUnary  dst <- op(a)
// `op` is a BinOp or UnOp value. The entry point (ndarray_backend_program.cc) validates it.

constexpr std::size_t kProgramBlock = 256;  // a multiple of every vector width

template <class T>
void program_block(const T* const* ins, T* const* outs, const std::int32_t* code,
                   std::size_t ncode, const double* scalars, std::size_t start, std::size_t len,
                   T (*regs)[kProgramBlock]) {
  const T* view[kProgramRegisters];
  for (std::size_t k = 0; k < ncode; ++k) {
    const std::int32_t* ins5 = code + 5 * k;
    const int kind = ins5[0], op = ins5[1], dst = ins5[2], a = ins5[3], b = ins5[4];
    // A result stored right away is computed into the output itself: the store's copy (a
    // fifth of a memory-bound update's time) is skipped. Safe because no output shares a
    // buffer with an input (the entry point checks), so no later read sees it early.
    T* target = regs[dst];
    if (kind != kLoad && kind != kStore && k + 1 < ncode && ins5[5] == kStore && ins5[8] == dst) {
      target = outs[ins5[7]] + start;
      ++k;
    }
    switch (kind) {
      case kLoad:
        view[dst] = ins[a] + start;
        break;
      case kStore:
        std::memcpy(outs[dst] + start, view[a], len * sizeof(T));
        break;
      case kBinary:
        switch (BinOp(op)) {
#define NEEDLE_CASE(name) \
  case BinOp::name: bin_loop_plain<BinOp::name, T>(view[a], view[b], target, len); break;
          NEEDLE_BIN_CASES(NEEDLE_CASE)
#undef NEEDLE_CASE
        }
        view[dst] = target;
        break;
      case kScalar:
      case kRScalar: {
        const T v = T(scalars[b]);  // as run_scalar rounds a Python scalar
        switch (BinOp(op)) {
#define NEEDLE_CASE(name)                                                                  \
  case BinOp::name:                                                                        \
    scalar_loop_plain<BinOp::name, T>(view[a], v, target, len, kind == kRScalar); break;
          NEEDLE_BIN_CASES(NEEDLE_CASE)
#undef NEEDLE_CASE
        }
        view[dst] = target;
        break;
      }
      case kUnary:
        switch (UnOp(op)) {
#define NEEDLE_CASE(name) \
  case UnOp::name: un_loop_plain<UnOp::name, T>(view[a], target, len); break;
          NEEDLE_CASE(neg) NEEDLE_CASE(log) NEEDLE_CASE(exp) NEEDLE_CASE(tanh) NEEDLE_CASE(sqrt)
          NEEDLE_CASE(abs) NEEDLE_CASE(sign) NEEDLE_CASE(sigmoid)
#undef NEEDLE_CASE
        }
        view[dst] = target;
        break;
      default:
        break;
    }
  }
}

template <class T>
void program_typed(const void* const* ins, void* const* outs, const std::int32_t* code,
                   std::size_t ncode, const double* scalars, std::size_t n) {
  const T* const* in = reinterpret_cast<const T* const*>(ins);
  T* const* out = reinterpret_cast<T* const*>(outs);
  const std::size_t blocks = (n + kProgramBlock - 1) / kProgramBlock;
  parallel_range(blocks, kParallelMinElements / kProgramBlock, [&](std::size_t s, std::size_t e) {
    alignas(64) T regs[kProgramRegisters][kProgramBlock];
    for (std::size_t blk = s; blk < e; ++blk) {
      const std::size_t start = blk * kProgramBlock;
      const std::size_t len = n - start < kProgramBlock ? n - start : kProgramBlock;
      program_block(in, out, code, ncode, scalars, start, len, regs);
    }
  }, 1);
}

void ewise_program(DType t, const void* const* ins, void* const* outs, const std::int32_t* code,
                   std::size_t ncode, const double* scalars, std::size_t n) {
  if (t == DType::f32) return program_typed<float>(ins, outs, code, ncode, scalars, n);
  if (t == DType::f64) return program_typed<double>(ins, outs, code, ncode, scalars, n);
  throw std::invalid_argument("ewise_program: expected float32 or float64");
}
