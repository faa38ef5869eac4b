// relu on the CPU: y = max(x, 0), NaN kept. Contiguous buffers; chunks run in parallel.
#include "relu_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace opb::relu {
namespace {

template <typename T>
void relu_typed(const T* x, T* y, int64_t n) {
  // 32K elements per task: large enough to amortise the thread pool, small enough to balance.
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // `x < 0` is false for NaN, so NaN passes through as torch.relu does.
      y[i] = x[i] < T(0) ? T(0) : x[i];
    }
  });
}

}  // namespace

void relu_cpu(const void* x, void* y, int64_t n, DType dtype) {
  switch (dtype) {
    case DType::Float32:
      return relu_typed(static_cast<const float*>(x), static_cast<float*>(y), n);
    case DType::Float16:
      return relu_typed(static_cast<const c10::Half*>(x), static_cast<c10::Half*>(y), n);
    case DType::BFloat16:
      return relu_typed(static_cast<const c10::BFloat16*>(x), static_cast<c10::BFloat16*>(y), n);
    case DType::Float64:
      return relu_typed(static_cast<const double*>(x), static_cast<double*>(y), n);
  }
}

}  // namespace opb::relu
