// softmax on the CPU: rows run in parallel; inside a row, SIMD through the compiler's vector
// extensions (GCC and Clang), as wide as the target's registers: a -march=native build (the JIT
// default) uses AVX-512 or AVX2, a generic build SSE2 (about 2x slower than torch's dispatched kernels).
//
// Forward, rows up to kCachedCols: max pass (x from memory), exp pass (x from cache; exp(x - max) into
// a float scratch row, summed; the next row prefetched meanwhile), scale pass (scratch * 1/sum into y):
// one exp per element and x read from memory once. Longer rows: one online pass (per chunk: max,
// rescale the running sum, add the chunk's exps) and one write pass, so x is read twice and never y.
// Arithmetic is float for float32/float16/bfloat16 and double for float64.
#include "softmax_cpu.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include "common/cpu_rows.h"

namespace opb::softmax {

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t VecU16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// Rows this long or shorter keep a float scratch copy (128 KB) in cache between passes.
constexpr int64_t kCachedCols = 32768;
// Elements per step of the online pass.
constexpr int64_t kChunk = 2048;

constexpr float kInf = std::numeric_limits<float>::infinity();

inline VecF splat(float a) { return VecF{} + a; }

inline VecF select(VecI mask, VecF a, VecF b) { return mask ? a : b; }

// exp, |relative error| < 2e-7: Cody-Waite reduction to r in [-ln2/2, ln2/2], degree-6 polynomial,
// scale by 2^n. Exactly 0 below -87 (so exp(-inf) = 0), NaN kept; inputs here are x - max <= 0.
inline VecF vexp(VecF x) {
  const VecF lo = splat(-87.f);
  const VecF hi = splat(88.f);
  const VecI nan = x != x;
  VecF xc = select(nan, splat(0.f), x);
  xc = select(xc < lo, lo, xc);
  xc = select(xc > hi, hi, xc);
  const VecF magic = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const VecF n = (xc * 1.44269504088896341f + magic) - magic;
  VecF r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VecF p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.f);
  const VecI bits = (__builtin_convertvector(n, VecI) + 127) << 23;
  const VecF result = select(x < lo, splat(0.f), p * (VecF)bits);
  return select(nan, x, result);
}

// max keeping NaN, lane by lane: a row holding NaN gives NaN everywhere, as torch does.
inline VecF vmax_nan(VecF a, VecF b) { return select((b > a) | (b != b), b, a); }

inline float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }
inline double max_nan(double a, double b) { return (b > a || b != b) ? b : a; }

inline float hmax(VecF v) {
  float m = -kInf;
  for (int j = 0; j < kLanes; ++j) m = max_nan(m, v[j]);
  return m;
}

inline float hsum(VecF v) {
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// ---- loading and storing kLanes elements as floats -----------------------------------------------

template <typename T>
inline VecF load(const T* p) {
  float tmp[kLanes];
  for (int j = 0; j < kLanes; ++j) tmp[j] = static_cast<float>(p[j]);
  VecF v;
  std::memcpy(&v, tmp, sizeof v);
  return v;
}

template <>
inline VecF load<float>(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <>
inline VecF load<BFloat16>(const BFloat16* p) {
  VecU16 h;
  std::memcpy(&h, p, sizeof h);
  const VecU bits = __builtin_convertvector(h, VecU) << 16;
  return (VecF)bits;
}

// float16 through common/cpu_rows.h (F16C, 8 at a time, where the build has it): the generic load and store
// convert one element at a time in software, which made a float16 softmax 3x slower than torch's.
template <>
inline VecF load<Half>(const Half* p) {
  float tmp[kLanes];
  cpu_rows::to_float(p, tmp, kLanes);
  VecF v;
  std::memcpy(&v, tmp, sizeof v);
  return v;
}

template <typename T>
inline void store(T* p, VecF v) {
  for (int j = 0; j < kLanes; ++j) p[j] = static_cast<T>(v[j]);
}

template <>
inline void store<Half>(Half* p, VecF v) {
  float tmp[kLanes];
  std::memcpy(tmp, &v, sizeof v);
  cpu_rows::from_float(tmp, p, kLanes);
}

template <>
inline void store<float>(float* p, VecF v) {
  std::memcpy(p, &v, sizeof v);
}

// Round to nearest even, NaN to the quiet NaN, as BFloat16's conversion does.
inline VecU16 to_bf16(VecF v) {
  const VecU bits = (VecU)v;
  const VecU rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  const VecU out = (v != v) ? VecU{} + 0x7fc0u : rounded;
  return __builtin_convertvector(out, VecU16);
}

template <>
inline void store<BFloat16>(BFloat16* p, VecF v) {
  const VecU16 h = to_bf16(v);
  std::memcpy(p, &h, sizeof h);
}

// The last n (< kLanes) elements of a row, the other lanes set to `fill`.
template <typename T>
inline VecF load_tail(const T* p, int64_t n, float fill) {
  float tmp[kLanes];
  for (int j = 0; j < kLanes; ++j) tmp[j] = j < n ? static_cast<float>(p[j]) : fill;
  return load<float>(tmp);
}

template <typename T>
inline void store_tail(T* p, int64_t n, VecF v) {
  for (int64_t j = 0; j < n; ++j) p[j] = static_cast<T>(v[j]);
}

// ---- per-row pieces (float arithmetic) -----------------------------------------------------------

// A row's sum of exps runs in the lanes of one vector, which drifts over a long row (32768 floats in the 4
// lanes of a build without AVX: 1.8e-5 relative, above float32's tolerance); the lanes sum blocks of
// kSumBlock elements, and the blocks add in double.
constexpr int64_t kSumBlock = 1024;
static_assert(kSumBlock % kLanes == 0);

// Whether the vector at element i is the last of its block.
inline bool block_ends(int64_t i) { return (i + kLanes) % kSumBlock == 0; }

// Applies f to each kLanes-wide piece of [0, n); the tail is padded with `fill`.
template <typename T, typename F>
inline void for_each_vec(const T* x, int64_t n, float fill, F&& f) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) f(i, load(x + i), kLanes);
  if (i < n) f(i, load_tail(x + i, n - i, fill), n - i);
}

template <typename T>
float row_max(const T* x, int64_t n) {
  // Four accumulators: the compare-and-blend chain, not the loads, would bound one.
  VecF m0 = splat(-kInf), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    m0 = vmax_nan(m0, load(x + i));
    m1 = vmax_nan(m1, load(x + i + kLanes));
    m2 = vmax_nan(m2, load(x + i + 2 * kLanes));
    m3 = vmax_nan(m3, load(x + i + 3 * kLanes));
  }
  VecF m = vmax_nan(vmax_nan(m0, m1), vmax_nan(m2, m3));
  for_each_vec(x + i, n - i, -kInf, [&](int64_t, VecF v, int64_t) { m = vmax_nan(m, v); });
  return hmax(m);
}

// sum of exp(x - m); -inf padding adds exp(-inf) = 0 (or NaN when m = -inf, where the row is NaN anyway).
template <typename T>
float row_exp_sum(const T* x, int64_t n, float m) {
  VecF s = splat(0.f);
  double total = 0.0;
  for_each_vec(x, n, -kInf, [&](int64_t i, VecF v, int64_t) {
    s += vexp(v - m);
    if (block_ends(i)) {
      total += hsum(s);
      s = splat(0.f);
    }
  });
  return static_cast<float>(total + hsum(s));
}

// `next`: the row after this one (or null), fetched into cache while the exp pass computes, so its
// max pass finds it there and memory stays busy.
template <typename T>
void forward_row_cached(const T* x, T* y, int64_t n, float* scratch, const T* next) {
  const float m = row_max(x, n);
  VecF s = splat(0.f);
  double total = 0.0;
  for_each_vec(x, n, -kInf, [&](int64_t i, VecF v, int64_t count) {
    if (next != nullptr) __builtin_prefetch(next + i);
    const VecF e = vexp(v - m);
    s += e;
    if (block_ends(i)) {
      total += hsum(s);
      s = splat(0.f);
    }
    if (count == kLanes) {
      store(scratch + i, e);
    } else {
      store_tail(scratch + i, count, e);
    }
  });
  // For an all -inf row m = -inf, every exp is NaN and so is the result, as in torch.
  const float inv = static_cast<float>(1.0 / (total + hsum(s)));
  for_each_vec(scratch, n, 0.f, [&](int64_t i, VecF e, int64_t count) {
    if (count == kLanes) {
      store(y + i, e * inv);
    } else {
      store_tail(y + i, count, e * inv);
    }
  });
}

template <typename T>
void forward_row_online(const T* x, T* y, int64_t n) {
  float m = -kInf;
  double s = 0.0;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    const float chunk_max = row_max(x + start, len);
    const float new_m = max_nan(m, chunk_max);
    if (!(new_m == m)) {
      // Rescale the sum so far; nothing to rescale while m is -inf (s is 0 then).
      s = m == -kInf ? 0.0 : s * std::exp(double(m) - double(new_m));
      m = new_m;
    }
    // While everything seen is -inf there is nothing to add (exp(-inf - -inf) would be NaN).
    if (m != -kInf) s += row_exp_sum(x + start, len, m);
  }
  const float inv = static_cast<float>(1.0 / s);
  for_each_vec(x, n, -kInf, [&](int64_t i, VecF v, int64_t count) {
    const VecF out = vexp(v - m) * inv;
    if (count == kLanes) {
      store(y + i, out);
    } else {
      store_tail(y + i, count, out);
    }
  });
}

template <typename T>
void backward_row(const T* y, const T* dy, T* dx, int64_t n) {
  VecF acc = splat(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(y + i) * load(dy + i);
  if (i < n) acc += load_tail(y + i, n - i, 0.f) * load_tail(dy + i, n - i, 0.f);
  const float dot = hsum(acc);
  for (i = 0; i + kLanes <= n; i += kLanes) store(dx + i, load(y + i) * (load(dy + i) - dot));
  if (i < n) store_tail(dx + i, n - i, load_tail(y + i, n - i, 0.f) * (load_tail(dy + i, n - i, 0.f) - dot));
}

// ---- float64 (gradcheck's dtype): plain loops, exact exp ------------------------------------------

void forward_row_f64(const double* x, double* y, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) m = max_nan(m, x[i]);
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i] - m);
  const double inv = 1.0 / s;
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i] - m) * inv;
}

void backward_row_f64(const double* y, const double* dy, double* dx, int64_t n) {
  double dot = 0.0;
  for (int64_t i = 0; i < n; ++i) dot += y[i] * dy[i];
  for (int64_t i = 0; i < n; ++i) dx[i] = y[i] * (dy[i] - dot);
}

// Rows per parallel task: at least ~32K elements of work, so the thread pool's cost stays small.
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

template <typename T>
void forward_typed(const T* x, T* y, int64_t rows, int64_t cols) {
  torch::stable::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, double>) {
      for (int64_t r = begin; r < end; ++r) forward_row_f64(x + r * cols, y + r * cols, cols);
    } else if (cols <= kCachedCols) {
      std::unique_ptr<float[]> scratch(new float[cols]);
      for (int64_t r = begin; r < end; ++r)
        forward_row_cached(x + r * cols, y + r * cols, cols, scratch.get(), r + 1 < end ? x + (r + 1) * cols : nullptr);
    } else {
      for (int64_t r = begin; r < end; ++r) forward_row_online(x + r * cols, y + r * cols, cols);
    }
  });
}

template <typename T>
void backward_typed(const T* y, const T* dy, T* dx, int64_t rows, int64_t cols) {
  torch::stable::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<T, double>) {
        backward_row_f64(y + r * cols, dy + r * cols, dx + r * cols, cols);
      } else {
        backward_row(y + r * cols, dy + r * cols, dx + r * cols, cols);
      }
    }
  });
}

}  // namespace

void forward_cpu(const void* x, void* y, int64_t rows, int64_t cols, DType dtype) {
  if (rows == 0 || cols == 0) return;
  switch (dtype) {
    case DType::Float32:
      return forward_typed(static_cast<const float*>(x), static_cast<float*>(y), rows, cols);
    case DType::Float16:
      return forward_typed(static_cast<const Half*>(x), static_cast<Half*>(y), rows, cols);
    case DType::BFloat16:
      return forward_typed(static_cast<const BFloat16*>(x), static_cast<BFloat16*>(y), rows, cols);
    case DType::Float64:
      return forward_typed(static_cast<const double*>(x), static_cast<double*>(y), rows, cols);
  }
}

void backward_cpu(const void* y, const void* grad_y, void* grad_x, int64_t rows, int64_t cols, DType dtype) {
  if (rows == 0 || cols == 0) return;
  switch (dtype) {
    case DType::Float32:
      return backward_typed(static_cast<const float*>(y), static_cast<const float*>(grad_y),
                            static_cast<float*>(grad_x), rows, cols);
    case DType::Float16:
      return backward_typed(static_cast<const Half*>(y), static_cast<const Half*>(grad_y),
                            static_cast<Half*>(grad_x), rows, cols);
    case DType::BFloat16:
      return backward_typed(static_cast<const BFloat16*>(y), static_cast<const BFloat16*>(grad_y),
                            static_cast<BFloat16*>(grad_x), rows, cols);
    case DType::Float64:
      return backward_typed(static_cast<const double*>(y), static_cast<const double*>(grad_y),
                            static_cast<double*>(grad_x), rows, cols);
  }
}

}  // namespace opb::softmax
