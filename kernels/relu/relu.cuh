// relu's CUDA launcher, as the binding sees it: raw pointers, a size and a stream; no torch types.
#pragma once

#include <cuda_runtime_api.h>
#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::relu {

// x, y: [n] contiguous, same dtype. Returns the launch's error code.
cudaError_t launch(const void* x, void* y, int64_t n, DType dtype, cudaStream_t stream);

}  // namespace opb::relu
