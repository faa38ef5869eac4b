// Helpers for the torch-facing binding (.cpp) of an op: dtype mapping, streams, error checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <opbuilder/dtype.h>
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
