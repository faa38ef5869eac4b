// relu's CPU kernel, as the binding sees it.
#pragma once

#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::relu {

// x, y: [n] contiguous, same dtype.
void relu_cpu(const void* x, void* y, int64_t n, DType dtype);

}  // namespace opb::relu
