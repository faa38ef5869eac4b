// fused_matmul_add_relu's CPU epilogue: one pass over the GEMM's output adding the (broadcast) bias
// and applying ReLU, rows in parallel.
#include "fused_matmul_add_relu_cpu.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <type_traits>

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

}  // namespace

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
