// fused_add_rmsnorm on the CPU: rows in parallel (torch::stable::parallel_for); per row one pass that adds, writes
// residual_out and sums squares, then one that scales (re-reading the row from cache). The reductions
// keep kLanes independent partial sums, so that the compiler vectorises them without -ffast-math.
#include "fused_add_rmsnorm_cpu.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/acc_type.h"
#include "common/cpu_rows.h"

namespace opb::fused_add_rmsnorm {

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
namespace {

constexpr int64_t kLanes = 16;

template <typename A>
A sum_lanes(const A (&lanes)[kLanes]) {
  A s = 0;
  for (int64_t k = 0; k < kLanes; ++k) s += lanes[k];
  return s;
}

// One row. h = residual_out (rounded to T) when there is a residual, else input.
template <typename T, typename A>
void forward_row(const T* x, const T* r, const T* w, T* out, T* res_out, int64_t n, A eps) {
  A lanes[kLanes] = {};
  const T* h = x;
  int64_t i = 0;
  if (r != nullptr) {
    h = res_out;
    for (; i + kLanes <= n; i += kLanes) {
      for (int64_t k = 0; k < kLanes; ++k) {
        const T hv = static_cast<T>(static_cast<A>(x[i + k]) + static_cast<A>(r[i + k]));
        res_out[i + k] = hv;
        const A v = static_cast<A>(hv);
        lanes[k] += v * v;
      }
    }
    for (; i < n; ++i) {
      const T hv = static_cast<T>(static_cast<A>(x[i]) + static_cast<A>(r[i]));
      res_out[i] = hv;
      const A v = static_cast<A>(hv);
      lanes[0] += v * v;
    }
  } else {
    for (; i + kLanes <= n; i += kLanes) {
      for (int64_t k = 0; k < kLanes; ++k) {
        const A v = static_cast<A>(x[i + k]);
        lanes[k] += v * v;
      }
    }
    for (; i < n; ++i) {
      const A v = static_cast<A>(x[i]);
      lanes[0] += v * v;
    }
  }
  const A rstd = A(1) / std::sqrt(sum_lanes(lanes) / static_cast<A>(n) + eps);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = static_cast<T>(static_cast<A>(h[j]) * rstd * static_cast<A>(w[j]));
  }
}

// forward_row for float16 and bfloat16, on float row buffers (common/cpu_rows.h): h, t and wf (the weight,
// converted once a task) hold n floats each. h is rounded to T (residual_out) before forward_row squares it.
template <typename T>
void forward_row_through_float(const T* x, const T* r, const float* wf, T* out, T* res_out, int64_t n, float eps,
                               float* h, float* t) {
  cpu_rows::to_float(x, h, n);
  if (r != nullptr) {
    cpu_rows::to_float(r, t, n);
    for (int64_t j = 0; j < n; ++j) h[j] += t[j];
    cpu_rows::from_float(h, res_out, n);
    cpu_rows::to_float(res_out, h, n);  // as rounded to T
  }
  forward_row<float, float>(h, nullptr, wf, t, nullptr, n, eps);
  cpu_rows::from_float(t, out, n);
}

template <typename T>
void forward_typed(const T* x, const T* r, const T* w, T* out, T* res_out, int64_t rows, int64_t hidden, double eps) {
  using A = typename AccOf<T>::type;
  // At least ~16K elements a task, to amortise the thread pool.
  const int64_t grain = std::max<int64_t>(1, 16384 / hidden);
  torch::stable::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(cpu_rows::kThroughFloat<T> ? 3 * hidden : 0);
    if constexpr (cpu_rows::kThroughFloat<T>) cpu_rows::to_float(w, buffers.data() + 2 * hidden, hidden);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t o = row * hidden;
      const T* rr = r != nullptr ? r + o : nullptr;
      T* ro = res_out != nullptr ? res_out + o : nullptr;
      if constexpr (cpu_rows::kThroughFloat<T>) {
        float* h = buffers.data();
        forward_row_through_float<T>(x + o, rr, h + 2 * hidden, out + o, ro, hidden, static_cast<float>(eps), h,
                                     h + hidden);
      } else {
        forward_row<T, A>(x + o, rr, w, out + o, ro, hidden, static_cast<A>(eps));
      }
    }
  });
}

// One row of the backward; adds this row's weight gradient into dw.
template <typename T, typename A>
void backward_row(const T* gy, const T* gr, const T* h, const T* w, T* dh, A* dw, int64_t n, A eps) {
  A hh[kLanes] = {}, gh[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) {
      const A hv = static_cast<A>(h[i + k]);
      hh[k] += hv * hv;
      gh[k] += static_cast<A>(gy[i + k]) * static_cast<A>(w[i + k]) * hv;
    }
  }
  for (; i < n; ++i) {
    const A hv = static_cast<A>(h[i]);
    hh[0] += hv * hv;
    gh[0] += static_cast<A>(gy[i]) * static_cast<A>(w[i]) * hv;
  }
  const A inv_n = A(1) / static_cast<A>(n);
  const A rstd = A(1) / std::sqrt(sum_lanes(hh) * inv_n + eps);
  const A c = sum_lanes(gh) * inv_n * rstd * rstd * rstd;
  if (gr != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      const A hv = static_cast<A>(h[j]);
      const A gv = static_cast<A>(gy[j]);
      dh[j] = static_cast<T>(rstd * gv * static_cast<A>(w[j]) - c * hv + static_cast<A>(gr[j]));
      dw[j] += gv * hv * rstd;
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const A hv = static_cast<A>(h[j]);
      const A gv = static_cast<A>(gy[j]);
      dh[j] = static_cast<T>(rstd * gv * static_cast<A>(w[j]) - c * hv);
      dw[j] += gv * hv * rstd;
    }
  }
}

template <typename T>
void backward_typed(const T* gy, const T* gr, const T* h, const T* w, T* dh, T* dh2, T* dw, int64_t rows,
                    int64_t hidden, double eps) {
  using A = typename AccOf<T>::type;
  // Rows are cut into a few chunks per thread, none smaller than aten's grain (32768 elements: a small
  // input stays on this thread, where waking the others would cost more than the work, and far more on a
  // busy machine); each chunk sums its weight gradient in its own row of `partial`, and the chunks are
  // added in order at the end.
  const int64_t by_size = std::max<int64_t>(1, rows * hidden / 32768);
  const int64_t want =
      std::min(by_size, std::max<int64_t>(1, static_cast<int64_t>(torch::stable::get_num_threads())) * 4);
  const int64_t per_chunk = (rows + std::min(rows, want) - 1) / std::min(rows, want);
  const int64_t chunks = (rows + per_chunk - 1) / per_chunk;
  std::vector<A> partial(static_cast<size_t>(chunks * hidden), A(0));
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    // float16 and bfloat16: the rows through float buffers (common/cpu_rows.h): gy, gr, h, dh and the weight.
    std::vector<float> buffers(cpu_rows::kThroughFloat<T> ? 5 * hidden : 0);
    float *gyf = buffers.data(), *grf = gyf + hidden, *hf = grf + hidden, *dhf = hf + hidden, *wf = dhf + hidden;
    if constexpr (cpu_rows::kThroughFloat<T>) cpu_rows::to_float(w, wf, hidden);
    for (int64_t c = begin; c < end; ++c) {
      A* dwc = partial.data() + c * hidden;
      const int64_t last = std::min(rows, (c + 1) * per_chunk);
      for (int64_t row = c * per_chunk; row < last; ++row) {
        const int64_t o = row * hidden;
        if constexpr (cpu_rows::kThroughFloat<T>) {
          cpu_rows::to_float(gy + o, gyf, hidden);
          cpu_rows::to_float(h + o, hf, hidden);
          if (gr != nullptr) cpu_rows::to_float(gr + o, grf, hidden);
          backward_row<float, float>(gyf, gr != nullptr ? grf : nullptr, hf, wf, dhf, dwc, hidden,
                                     static_cast<float>(eps));
          cpu_rows::from_float(dhf, dh + o, hidden);
        } else {
          backward_row<T, A>(gy + o, gr != nullptr ? gr + o : nullptr, h + o, w, dh + o, dwc, hidden,
                             static_cast<A>(eps));
        }
        if (dh2 != nullptr) std::memcpy(dh2 + o, dh + o, static_cast<size_t>(hidden) * sizeof(T));  // still in cache
      }
    }
  });
  torch::stable::parallel_for(0, hidden, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      A s = 0;
      for (int64_t c = 0; c < chunks; ++c) s += partial[c * hidden + j];
      dw[j] = static_cast<T>(s);
    }
  });
}

}  // namespace

void forward_cpu(const void* input, const void* residual, const void* weight, void* out, void* residual_out,
                 int64_t rows, int64_t hidden, double eps, DType dtype) {
  if (rows <= 0 || hidden <= 0) return;
  switch (dtype) {
#define OPB_CASE(D, T)                                                                                          \
  case DType::D:                                                                                                \
    return forward_typed(static_cast<const T*>(input), static_cast<const T*>(residual),                        \
                         static_cast<const T*>(weight), static_cast<T*>(out), static_cast<T*>(residual_out), rows, \
                         hidden, eps);
    OPB_CASE(Float32, float)
    OPB_CASE(Float16, Half)
    OPB_CASE(BFloat16, BFloat16)
    OPB_CASE(Float64, double)
#undef OPB_CASE
  }
}

void backward_cpu(const void* grad_out, const void* grad_residual_out, const void* h, const void* weight, void* grad_h,
                  void* grad_h2, void* grad_weight, int64_t rows, int64_t hidden, double eps, DType dtype) {
  if (rows <= 0 || hidden <= 0) return;
  switch (dtype) {
#define OPB_CASE(D, T)                                                                                            \
  case DType::D:                                                                                                  \
    return backward_typed(static_cast<const T*>(grad_out), static_cast<const T*>(grad_residual_out),             \
                          static_cast<const T*>(h), static_cast<const T*>(weight), static_cast<T*>(grad_h),      \
                          static_cast<T*>(grad_h2), static_cast<T*>(grad_weight), rows, hidden, eps);
    OPB_CASE(Float32, float)
    OPB_CASE(Float16, Half)
    OPB_CASE(BFloat16, BFloat16)
    OPB_CASE(Float64, double)
#undef OPB_CASE
  }
}

}  // namespace opb::fused_add_rmsnorm
