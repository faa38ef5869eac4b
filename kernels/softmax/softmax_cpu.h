// softmax's CPU kernels, as the binding sees them. All buffers are contiguous [rows, cols], one dtype;
// the softmax runs over cols.
#pragma once

#include <cstddef>
#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::softmax {


// y = exp(x - max) / sum(exp(x - max)) per row.
void forward_cpu(const void* x, void* y, int64_t rows, int64_t cols, DType dtype);

// grad_x = y * (grad_y - sum(grad_y * y)) per row; y is the forward output.
void backward_cpu(const void* y, const void* grad_y, void* grad_x, int64_t rows, int64_t cols, DType dtype);

}  // namespace opb::softmax
