// The per-element-type launchers of softmax, each explicitly instantiated in its own .cu file
// (softmax_forward_<type>.cu, softmax_backward_<type>.cu); softmax_forward.cu and softmax_backward.cu
// pick one from the DType.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "softmax.cuh"

namespace opb::softmax {

template <typename T>
cudaError_t forward_vec(const Problem& p, const Plan& plan, const void* x, void* y, void* workspace,
                        cudaStream_t stream);

template <typename T>
cudaError_t backward_vec(const Problem& p, const Plan& plan, const void* y, const void* dy, void* dx,
                         void* workspace, cudaStream_t stream);

}  // namespace opb::softmax
