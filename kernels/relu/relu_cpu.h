// relu's CPU kernel, as the binding sees it.
#pragma once

#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::relu {

// x, y: [n] contiguous, same dtype.
void relu_cpu(const void* x, void* y, int64_t n, DType dtype);

// relu that also writes the sign mask (relu_mask.h), and the backward from it (dx = dy where the bit is
// 1, else 0). dy, dx: [n] contiguous.
void relu_mask_cpu(const void* x, void* y, void* mask, int64_t n, DType dtype);
void relu_mask_backward_cpu(const void* dy, const void* mask, void* dx, int64_t n, DType dtype);

}  // namespace opb::relu
