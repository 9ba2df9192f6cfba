// Uniform draws from NumPy's legacy generator, made in place of it (kernels.h, uniform_fill).
// Included by kernels_impl.h inside namespace needle::<isa>, so each instruction set gets its
// own vectorised copy.
//
// `np.random.rand` on the global RandomState draws each double with its bit generator's
// next_double. For the Mersenne Twister (MT19937, Matsumoto and Nishimura 1998) that is
// genrand_res53: two tempered 32-bit words a, b give ((a >> 5) * 2^26 + (b >> 6)) / 2^53, an
// exact double in [0, 1). The state is NumPy's own struct (624 words, then the int position
// of the next word), and it is advanced exactly as NumPy advances it, so a draw made here and
// one made by NumPy are interchangeable, and NumPy's next draw continues the sequence.
//
// Why it exists: a Dropout mask of 128 x 100 took ~90 µs through NumPy (one indirect call per
// double, a float64 array, then a cast and a comparison as two more passes); here the twist,
// the tempering and the conversion are plain loops the compiler vectorises, and the mask is
// written directly.

constexpr int kMtWords = kMt19937Words;  // N
constexpr int kMtShift = 397;            // M
constexpr std::uint32_t kMtMatrix = 0x9908b0dfu;
constexpr std::uint32_t kMtUpper = 0x80000000u;
constexpr std::uint32_t kMtLower = 0x7fffffffu;

inline std::uint32_t mt_mix(std::uint32_t high, std::uint32_t low, std::uint32_t far) {
  const std::uint32_t y = (high & kMtUpper) | (low & kMtLower);
  return far ^ (y >> 1) ^ ((0u - (y & 1u)) & kMtMatrix);
}

// Refills the key with the next 624 words. Each loop reads words it has not written yet (the
// first: i + 1 and i + 397; the second: i + 1, and i - 227, written at least 227 steps
// earlier), so the compiler may run them in vectors of up to 227 lanes.
inline void mt_twist(std::uint32_t* key) {
  int i = 0;
  for (; i < kMtWords - kMtShift; ++i) key[i] = mt_mix(key[i], key[i + 1], key[i + kMtShift]);
  for (; i < kMtWords - 1; ++i) {
    key[i] = mt_mix(key[i], key[i + 1], key[i + kMtShift - kMtWords]);
  }
  key[kMtWords - 1] = mt_mix(key[kMtWords - 1], key[0], key[kMtShift - 1]);
}

inline void mt_temper(const std::uint32_t* key, std::uint32_t* out, int n) {
  for (int i = 0; i < n; ++i) {
    std::uint32_t y = key[i];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    out[i] = y;
  }
}

// The double of genrand_res53 from its two words; every step is exact.
inline double mt_res53(std::uint32_t a, std::uint32_t b) {
  return (double(a >> 5) * 67108864.0 + double(b >> 6)) * (1.0 / 9007199254740992.0);
}

// out[i] = the i-th draw u as T (rounded as NumPy's astype rounds), or, when `below`, 1 where
// T(u) <= T(p) and 0 elsewhere (NumPy's `rand(...).astype(T) <= p` with p of T's precision).
template <class T>
inline void mt_emit(const std::uint32_t* w, T* out, std::size_t pairs, bool below, T p) {
  if (below) {
    for (std::size_t j = 0; j < pairs; ++j) {
      out[j] = T(mt_res53(w[2 * j], w[2 * j + 1])) <= p ? T(1) : T(0);
    }
  } else {
    for (std::size_t j = 0; j < pairs; ++j) out[j] = T(mt_res53(w[2 * j], w[2 * j + 1]));
  }
}

template <class T>
void mt_fill(Mt19937State* s, T* out, std::size_t n, bool below, T p) {
  alignas(64) std::uint32_t words[kMtWords + 1];
  bool pending = false;  // words[0] holds the first word of a pair cut by a twist
  std::size_t done = 0;
  while (done < n) {
    if (s->pos >= kMtWords) {
      mt_twist(s->key);
      s->pos = 0;
    }
    const std::size_t left = 2 * (n - done) - (pending ? 1 : 0);  // words still needed
    const int take = int(std::min<std::size_t>(left, std::size_t(kMtWords - s->pos)));
    const int at = pending ? 1 : 0;
    mt_temper(s->key + s->pos, words + at, take);
    s->pos += take;
    const int have = at + take;
    const std::size_t pairs = std::size_t(have / 2);
    mt_emit(words, out + done, pairs, below, p);
    done += pairs;
    pending = (have & 1) != 0;
    if (pending) words[0] = words[have - 1];
  }
}

// The table entry (kernels.h); t is float32 or float64.
void uniform_fill(Mt19937State* s, DType t, void* out, std::size_t n, bool below, double p) {
  if (t == DType::f32) {
    mt_fill(s, static_cast<float*>(out), n, below, float(p));
  } else {
    mt_fill(s, static_cast<double*>(out), n, below, p);
  }
}
