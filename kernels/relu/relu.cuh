// relu's CUDA launcher, as the binding sees it: raw pointers, a size and a stream; no torch types.
#pragma once

#include <cuda_runtime_api.h>
#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::relu {

// x, y: [n] contiguous, same dtype. Returns the launch's error code.
cudaError_t launch(const void* x, void* y, int64_t n, DType dtype, cudaStream_t stream);

// relu that also writes the sign mask (relu_mask.h: mask_words(n, element size) 32-bit words, 16-byte
// aligned), and the backward from it: dx = dy where the bit is 1, else 0. dy, dx: [n] contiguous.
cudaError_t launch_mask(const void* x, void* y, void* mask, int64_t n, DType dtype, cudaStream_t stream);
cudaError_t launch_mask_backward(const void* dy, const void* mask, void* dx, int64_t n, DType dtype,
                                 cudaStream_t stream);

}  // namespace opb::relu
