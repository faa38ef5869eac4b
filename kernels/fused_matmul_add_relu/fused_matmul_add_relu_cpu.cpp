// fused_matmul_add_relu on the CPU: the forward's epilogue (one pass over the GEMM's output adding the
// broadcast bias and applying ReLU, rows in parallel) and the backward's ReLU + bias pass.
#include "fused_matmul_add_relu_cpu.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/acc_type.h"

namespace opb::fused_matmul_add_relu {

using torch::headeronly::BFloat16;
using torch::headeronly::Half;
namespace {

template <typename T>
inline T relu1(acc_t<T> v) {
  // `v < 0` is false for NaN, so NaN passes through as torch.relu does.
  return static_cast<T>(v < acc_t<T>(0) ? acc_t<T>(0) : v);
}

template <typename T>
void bias_relu_typed(T* out, const T* bias, int64_t batch, int64_t rows, int64_t cols, int64_t sb, int64_t sr,
                     int64_t sc) {
  using A = acc_t<T>;
  // About 32K elements per task: large enough to amortise the thread pool, small enough to balance.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1));
  torch::stable::parallel_for(0, batch * rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* o = out + i * cols;
      if (bias == nullptr) {
        for (int64_t j = 0; j < cols; ++j) o[j] = relu1<T>(static_cast<A>(o[j]));
        continue;
      }
      const T* b = bias + (i / rows) * sb + (i % rows) * sr;
      if (sc == 1) {  // a bias row: the common case, kept a plain loop so the compiler vectorises it
        for (int64_t j = 0; j < cols; ++j) o[j] = relu1<T>(static_cast<A>(o[j]) + static_cast<A>(b[j]));
      } else if (sc == 0) {  // one value per output row ([M, 1] or scalar bias)
        const A bv = static_cast<A>(b[0]);
        for (int64_t j = 0; j < cols; ++j) o[j] = relu1<T>(static_cast<A>(o[j]) + bv);
      } else {
        for (int64_t j = 0; j < cols; ++j) o[j] = relu1<T>(static_cast<A>(o[j]) + static_cast<A>(b[j * sc]));
      }
    }
  });
}

// The backward's row chunks, each a task with its own column sums: about 16K elements a chunk and at most 64
// chunks (the sums' buffer stays at 64 rows), fixed by the shape alone, not by the thread count, so the sums'
// order, and with it the result, is the same whatever the thread count. (The gradient paths take ATen's ops
// on the CPU; this kernel serves direct calls, scalar for 16-bit types.)
int64_t row_chunks(int64_t rows, int64_t cols) {
  const int64_t want = (rows * cols + 16383) / 16384;
  return std::min<int64_t>(std::max<int64_t>(want, 1), std::min<int64_t>(rows, 64));
}

template <typename T>
void relu_bias_backward_typed(const T* grad, const T* out, T* grad_pre, T* grad_bias, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  const int64_t chunks = row_chunks(rows, cols);
  const int64_t per = (rows + chunks - 1) / chunks;
  std::vector<A> partial(static_cast<size_t>(chunks * cols), A(0));
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      A* acc = partial.data() + ch * cols;
      const int64_t r1 = std::min(rows, (ch + 1) * per);
      for (int64_t r = ch * per; r < r1; ++r) {
        const T* g = grad + r * cols;
        const T* o = out + r * cols;
        T* d = grad_pre + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          // As threshold_backward: zero where out <= 0, the gradient elsewhere (NaN out included).
          const bool off = static_cast<A>(o[c]) <= A(0);
          d[c] = off ? static_cast<T>(A(0)) : g[c];
          acc[c] += off ? A(0) : static_cast<A>(g[c]);
        }
      }
    }
  });
  torch::stable::parallel_for(0, cols, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      A s = A(0);
      for (int64_t ch = 0; ch < chunks; ++ch) s += partial[ch * cols + c];
      grad_bias[c] = static_cast<T>(s);
    }
  });
}

}  // namespace

void relu_bias_backward_cpu(const void* grad, const void* out, void* grad_pre, void* grad_bias, int64_t rows,
                            int64_t cols, DType dtype) {
  if (rows <= 0 || cols <= 0) return;
  switch (dtype) {
    case DType::Float32:
      return relu_bias_backward_typed(static_cast<const float*>(grad), static_cast<const float*>(out),
                                      static_cast<float*>(grad_pre), static_cast<float*>(grad_bias), rows, cols);
    case DType::Float16:
      return relu_bias_backward_typed(static_cast<const Half*>(grad), static_cast<const Half*>(out),
                                      static_cast<Half*>(grad_pre), static_cast<Half*>(grad_bias), rows, cols);
    case DType::BFloat16:
      return relu_bias_backward_typed(static_cast<const BFloat16*>(grad), static_cast<const BFloat16*>(out),
                                      static_cast<BFloat16*>(grad_pre), static_cast<BFloat16*>(grad_bias), rows,
                                      cols);
    case DType::Float64:
      return relu_bias_backward_typed(static_cast<const double*>(grad), static_cast<const double*>(out),
                                      static_cast<double*>(grad_pre), static_cast<double*>(grad_bias), rows, cols);
  }
}

void bias_relu_cpu(void* out, const void* bias, int64_t batch, int64_t rows, int64_t cols, int64_t bias_sb,
                   int64_t bias_sr, int64_t bias_sc, DType dtype) {
  switch (dtype) {
    case DType::Float32:
      return bias_relu_typed(static_cast<float*>(out), static_cast<const float*>(bias), batch, rows, cols, bias_sb,
                             bias_sr, bias_sc);
    case DType::Float16:
      return bias_relu_typed(static_cast<Half*>(out), static_cast<const Half*>(bias), batch, rows, cols,
                             bias_sb, bias_sr, bias_sc);
    case DType::BFloat16:
      return bias_relu_typed(static_cast<BFloat16*>(out), static_cast<const BFloat16*>(bias), batch, rows,
                             cols, bias_sb, bias_sr, bias_sc);
    case DType::Float64:
      return bias_relu_typed(static_cast<double*>(out), static_cast<const double*>(bias), batch, rows, cols, bias_sb,
                             bias_sr, bias_sc);
  }
}

}  // namespace opb::fused_matmul_add_relu
