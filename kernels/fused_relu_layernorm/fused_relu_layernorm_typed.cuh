// The per-element-type entry points, defined (explicitly instantiated) in one .cu file per type so
// that nvcc compiles the types in parallel; fused_relu_layernorm.cu picks one from the DType.
#pragma once

#include <cuda_runtime_api.h>
#include <cstdint>

#include "fused_relu_layernorm.cuh"

namespace opb::fused_relu_layernorm {

// How one backward runs: with `launch` false only the number of partial rows is worked out (the
// binding sizes the workspace from it), so the plan and the launch cannot disagree.
struct BwdPlan {
  int64_t n_part = 0;
  cudaError_t err = cudaSuccess;
};

template <typename T>
cudaError_t forward_typed(const FwdArgs& args, cudaStream_t stream);

template <typename T>
BwdPlan backward_typed(const BwdArgs& args, cudaStream_t stream, bool launch);

}  // namespace opb::fused_relu_layernorm
