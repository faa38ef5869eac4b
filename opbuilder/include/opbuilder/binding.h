// Helpers for the torch-facing binding (.cpp) of an op: dtype mapping, streams, error checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>

#include <opbuilder/dtype.h>
#include <opbuilder/huge_pages.h>
#include <opbuilder/library.h>

#ifdef OPB_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace opb {

// The launcher-side element type of `t`, or a RuntimeError naming the op and the argument.
inline DType dtype_of(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kDouble: return DType::Float64;
    default:
      TORCH_CHECK(false, op, ": ", arg, " must be float32, float16, bfloat16 or float64, got ", t.scalar_type());
  }
}


// An op's output: contiguous, shaped and typed like `like`, on its device; on the CPU with the huge-page
// hint, which every large output written once wants.
inline at::Tensor new_output(const at::Tensor& like) {
  at::Tensor t = like.new_empty(like.sizes());
  if (t.is_cpu()) advise_huge_pages(t.mutable_data_ptr(), t.nbytes());
  return t;
}

#ifdef OPB_WITH_CUDA
// The stream torch is using on `t`'s device: kernels launched on it order with torch's own work.
inline cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}
#endif

}  // namespace opb
