// fused_relu_layernorm on the CPU. Rows run in parallel. Within a row, sums run over blocks of kBlock
// elements in kLanes independent accumulators, so the compiler vectorizes them (one running float sum
// cannot be reordered), and the block sums are added in double, so the error does not grow with the
// row length. Variance is two-pass over a row buffer that stays in L1.
#include "fused_relu_layernorm_cpu.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/acc_type.h"
#include "common/cpu_rows.h"

namespace opb::fused_relu_layernorm {

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
namespace {

template <typename A>
constexpr int kLanes = 64 / sizeof(A);  // one 512-bit register's worth

// v where `keep`, else +0, by its bits rather than a branch or a select on floats: GCC (with its default
// -ftrapping-math) vectorizes no loop that picks between float values computed in it ("control flow in loop").
template <typename A>
inline A keep_if(bool keep, A v) {
  using Bits = std::conditional_t<sizeof(A) == 4, uint32_t, uint64_t>;
  static_assert(sizeof(A) == sizeof(Bits));
  Bits b;
  std::memcpy(&b, &v, sizeof b);
  b &= Bits(0) - Bits(keep);
  std::memcpy(&v, &b, sizeof b);
  return v;
}

// relu that keeps NaN and -0.0, as torch.relu: `v < 0` is false for both.
template <typename A>
inline A relu(A v) {
  return keep_if(!(v < A(0)), v);
}

// Rows per parallel task: at least ~32K elements, so the thread pool's overhead stays small.
inline int64_t row_grain(int64_t hidden) { return std::max<int64_t>(1, 32768 / hidden); }

constexpr int64_t kBlock = 2048;

// Sums of NS terms over j in [0, n): term(j, out) writes the NS terms of element j into out[0..NS).
// Lanes within a block, blocks in double.
template <typename A, int NS, typename Term>
inline void row_sums(int64_t n, Term term, double (&total)[NS]) {
  constexpr int L = kLanes<A>;
  for (int s = 0; s < NS; ++s) total[s] = 0.0;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = std::min(n, j0 + kBlock);
    A acc[NS][L] = {};
    int64_t j = j0;
    for (; j + L <= j1; j += L) {
      for (int k = 0; k < L; ++k) {
        A t[NS];
        term(j + k, t);
        for (int s = 0; s < NS; ++s) acc[s][k] += t[s];
      }
    }
    for (int s = 0; s < NS; ++s) {
      A block = A(0);
      for (int k = 0; k < L; ++k) block += acc[s][k];
      total[s] += static_cast<double>(block);
    }
    for (; j < j1; ++j) {
      A t[NS];
      term(j, t);
      for (int s = 0; s < NS; ++s) total[s] += static_cast<double>(t[s]);
    }
  }
}

// buf[j] = relu(x[j]) as A; returns the sum.
template <typename T, typename A>
double relu_into(const T* x, A* buf, int64_t n) {
  double sum[1];
  row_sums<A, 1>(n, [&](int64_t j, A* t) {
    const A v = relu(static_cast<A>(x[j]));
    buf[j] = v;
    t[0] = v;
  }, sum);
  return sum[0];
}

template <typename A>
double sum_sq_dev(const A* buf, int64_t n, A mean) {
  double sum[1];
  row_sums<A, 1>(n, [&](int64_t j, A* t) {
    const A d = buf[j] - mean;
    t[0] = d * d;
  }, sum);
  return sum[0];
}

// out[j] = (v[j] - mean) * rstd * w[j] + b[j] as O, without the weight or the bias where they are null.
template <typename O, typename A>
void write_y(O* out, const A* v, A mean, A rstd, const A* w, const A* b, int64_t n) {
  if (w != nullptr && b != nullptr) {
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<O>((v[j] - mean) * rstd * w[j] + b[j]);
  } else if (w != nullptr) {
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<O>((v[j] - mean) * rstd * w[j]);
  } else if (b != nullptr) {
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<O>((v[j] - mean) * rstd + b[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<O>((v[j] - mean) * rstd);
  }
}

// The forward converts float16 rows through a float buffer (common/cpu_rows.h), not bfloat16: bfloat16's
// loads and stores vectorize in the loops themselves, and the buffer's two more passes made its forward slower
// (512 x 1024, one thread, CPU time: 431-510 us against 280-364).
template <typename T>
constexpr bool kRowsThroughFloat = std::is_same_v<T, Half>;

template <typename T>
void forward_typed(const FwdArgs& a) {
  using A = acc_t<T>;
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  const T* b = static_cast<const T*>(a.b);
  T* y = static_cast<T*>(a.y);
  A* mean_out = static_cast<A*>(a.mean);
  A* rstd_out = static_cast<A*>(a.rstd);
  const int64_t n = a.hidden;
  const double eps = a.eps;

  torch::stable::parallel_for(0, a.rows, row_grain(n), [&](int64_t r0, int64_t r1) {
    std::vector<A> buf(n);
    // The weight and bias as A, once per task rather than once per element and row.
    std::vector<A> wa(w != nullptr ? n : 0), ba(b != nullptr ? n : 0);
    for (int64_t j = 0; j < static_cast<int64_t>(wa.size()); ++j) wa[j] = static_cast<A>(w[j]);
    for (int64_t j = 0; j < static_cast<int64_t>(ba.size()); ++j) ba[j] = static_cast<A>(b[j]);
    for (int64_t r = r0; r < r1; ++r) {
      double sum;
      if constexpr (kRowsThroughFloat<T>) {
        cpu_rows::to_float(x + r * n, buf.data(), n);
        sum = relu_into(buf.data(), buf.data(), n);
      } else {
        sum = relu_into(x + r * n, buf.data(), n);
      }
      A mean = static_cast<A>(sum / double(n));
      if constexpr (std::is_same_v<A, double>) {
        // sum / n in double can be an ulp off; one correction pass makes a constant row's mean exact,
        // so its variance is exactly 0 (and eps = 0 gives 0/0 = NaN, as torch does).
        double dev[1];
        row_sums<A, 1>(n, [&](int64_t j, A* t) { t[0] = buf[j] - mean; }, dev);
        mean += dev[0] / double(n);
      }
      double var = sum_sq_dev(buf.data(), n, mean) / double(n);
      if constexpr (!std::is_same_v<A, double>) {
        // A row whose spread is below 1e-4 of its mean (a constant row above all): the float lanes' sums (128 terms
        // a lane in a block) can put the mean ulps off every value. One more pass moves it onto them, so that
        // x - mean is 0 exactly on a constant row (0 x an infinite weight is NaN, as in float64), and takes the shift
        // off the variance (the corrected two-pass variance). Other rows skip it.
        const double m = static_cast<double>(mean);
        if (var <= m * m * 1e-8) {
          double dev[1];
          row_sums<A, 1>(n, [&](int64_t j, A* t) { t[0] = buf[j] - mean; }, dev);
          const double shift = dev[0] / double(n);
          mean += static_cast<A>(shift);
          var = std::max(0.0, var - shift * shift);
        }
      }
      const A rstd = static_cast<A>(1.0 / std::sqrt(var + eps));
      mean_out[r] = mean;
      rstd_out[r] = rstd;
      T* yr = y + r * n;
      A* v = buf.data();
      if constexpr (kRowsThroughFloat<T>) {  // y over the row buffer (in place), then converted
        write_y(v, v, mean, rstd, w != nullptr ? wa.data() : nullptr, b != nullptr ? ba.data() : nullptr, n);
        cpu_rows::from_float(v, yr, n);
      } else {
        write_y(yr, v, mean, rstd, w != nullptr ? wa.data() : nullptr, b != nullptr ? ba.data() : nullptr, n);
      }
    }
  });
}

// One row of the backward. g = dy * w, xhat = (relu(x) - mean) * rstd:
//   dx = [x > 0] * rstd * (g - (xhat * mean(g * xhat) + mean(g)))
// and, with kAffine, pdw += dy * xhat, pdb += dy. The second pass re-reads the row from cache. One instance per
// case (weight or not, affine gradients or not) and no branch on the values, so the compiler vectorizes the second
// pass: with the cases and relu's tests left to branches it ran one element at a time, mispredicting on the signs
// (256 x 1024 floats, one thread: 2.4 ms against aten's 0.22 for layer norm's backward alone).
template <typename T, typename A, bool kWeight, bool kAffine>
void backward_row_as(const T* __restrict__ x, const T* __restrict__ dy, const A* __restrict__ wa, A mean, A rstd,
                     T* __restrict__ dx, A* __restrict__ pdw, A* __restrict__ pdb, int64_t n) {
  double sums[2];
  row_sums<A, 2>(n, [&](int64_t j, A* t) {
    const A xh = (relu(static_cast<A>(x[j])) - mean) * rstd;
    const A g = kWeight ? static_cast<A>(dy[j]) * wa[j] : static_cast<A>(dy[j]);
    t[0] = g * xh;
    t[1] = g;
  }, sums);
  const A c1 = static_cast<A>(sums[0] / double(n)), c2 = static_cast<A>(sums[1] / double(n));
  for (int64_t i = 0; i < n; ++i) {
    const A xv = static_cast<A>(x[i]);
    const A dyv = static_cast<A>(dy[i]);
    const A xh = (relu(xv) - mean) * rstd;
    const A g = kWeight ? dyv * wa[i] : dyv;
    const A d = rstd * (g - (xh * c1 + c2));
    // relu's gradient, as threshold_backward: +0 where x <= 0, whatever d is there.
    dx[i] = static_cast<T>(keep_if(!(xv <= A(0)), d));
    if constexpr (kAffine) {
      pdw[i] += dyv * xh;
      pdb[i] += dyv;
    }
  }
}

template <typename T, typename A>
void backward_row(const T* x, const T* dy, const A* wa, A mean, A rstd, T* dx, A* pdw, A* pdb, int64_t n) {
  if (wa != nullptr && pdw != nullptr) return backward_row_as<T, A, true, true>(x, dy, wa, mean, rstd, dx, pdw, pdb, n);
  if (wa != nullptr) return backward_row_as<T, A, true, false>(x, dy, wa, mean, rstd, dx, pdw, pdb, n);
  if (pdw != nullptr) return backward_row_as<T, A, false, true>(x, dy, wa, mean, rstd, dx, pdw, pdb, n);
  return backward_row_as<T, A, false, false>(x, dy, wa, mean, rstd, dx, pdw, pdb, n);
}

template <typename T>
void backward_typed(const BwdArgs& a) {
  using A = acc_t<T>;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const T* w = static_cast<const T*>(a.w);
  const A* mean = static_cast<const A*>(a.mean);
  const A* rstd = static_cast<const A*>(a.rstd);
  T* dx = static_cast<T*>(a.dx);
  const int64_t n = a.hidden;
  const bool affine = a.dw != nullptr;

  std::vector<A> wa(w != nullptr ? n : 0);
  for (int64_t j = 0; j < static_cast<int64_t>(wa.size()); ++j) wa[j] = static_cast<A>(w[j]);
  const A* wp = w != nullptr ? wa.data() : nullptr;

  // A fixed split of the rows into chunks, one partial dw/db row each, summed in chunk order below:
  // the result does not depend on how the thread pool schedules the chunks. None smaller than aten's grain
  // (32768 elements): a small input stays on this thread, where waking the others costs more than the work.
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t by_size = std::max<int64_t>(1, a.rows * n / 32768);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>({a.rows, threads, by_size}));
  const int64_t per_chunk = (a.rows + chunks - 1) / chunks;
  std::vector<A> part(affine ? 2 * chunks * n : 0, A(0));
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    // float16: x, dy and dx a row at a time through float buffers (see kRowsThroughFloat).
    std::vector<A> rows_as_a(kRowsThroughFloat<T> ? 3 * n : 0);
    for (int64_t c = c0; c < c1; ++c) {
      A* pdw = affine ? part.data() + (2 * c) * n : nullptr;
      A* pdb = affine ? part.data() + (2 * c + 1) * n : nullptr;
      const int64_t r_end = std::min(a.rows, (c + 1) * per_chunk);
      for (int64_t r = c * per_chunk; r < r_end; ++r) {
        if constexpr (kRowsThroughFloat<T>) {
          A *xa = rows_as_a.data(), *dya = xa + n, *dxa = dya + n;
          cpu_rows::to_float(x + r * n, xa, n);
          cpu_rows::to_float(dy + r * n, dya, n);
          backward_row(xa, dya, wp, mean[r], rstd[r], dxa, pdw, pdb, n);
          cpu_rows::from_float(dxa, dx + r * n, n);
        } else {
          backward_row(x + r * n, dy + r * n, wp, mean[r], rstd[r], dx + r * n, pdw, pdb, n);
        }
      }
    }
  });
  if (!affine) return;
  T* dw = static_cast<T*>(a.dw);
  T* db = static_cast<T*>(a.db);
  torch::stable::parallel_for(0, n, 4096, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      A sw = A(0), sb = A(0);
      for (int64_t c = 0; c < chunks; ++c) {
        sw += part[(2 * c) * n + j];
        sb += part[(2 * c + 1) * n + j];
      }
      dw[j] = static_cast<T>(sw);
      db[j] = static_cast<T>(sb);
    }
  });
}

}  // namespace

void forward_cpu(const FwdArgs& args) {
  switch (args.dtype) {
    case DType::Float32: return forward_typed<float>(args);
    case DType::Float16: return forward_typed<Half>(args);
    case DType::BFloat16: return forward_typed<BFloat16>(args);
    case DType::Float64: return forward_typed<double>(args);
  }
}

void backward_cpu(const BwdArgs& args) {
  switch (args.dtype) {
    case DType::Float32: return backward_typed<float>(args);
    case DType::Float16: return backward_typed<Half>(args);
    case DType::BFloat16: return backward_typed<BFloat16>(args);
    case DType::Float64: return backward_typed<double>(args);
  }
}

}  // namespace opb::fused_relu_layernorm
