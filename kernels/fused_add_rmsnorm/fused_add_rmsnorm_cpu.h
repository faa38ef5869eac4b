// fused_add_rmsnorm's CPU kernels, as the binding sees them: raw pointers and sizes.
#pragma once

#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::fused_add_rmsnorm {

// input, out: [rows, hidden]; weight: [hidden]; contiguous, one dtype.
// residual != nullptr: h = round_to_dtype(input + residual) is written to residual_out [rows, hidden];
// residual == nullptr: plain RMSNorm of input (residual_out unused).
// out = h * rsqrt(mean(h^2) + eps) * weight, accumulated in fp32 (fp64 for Float64).
void forward_cpu(const void* input, const void* residual, const void* weight, void* out, void* residual_out,
                 int64_t rows, int64_t hidden, double eps, DType dtype);

// grad_out, h (the forward's residual_out, or RMSNorm's input), grad_h: [rows, hidden];
// grad_residual_out: [rows, hidden] or nullptr; weight, grad_weight: [hidden].
// grad_h is the gradient of both input and residual; grad_h2 (nullable) gets a copy of each row of it.
// Deterministic for a given thread count.
void backward_cpu(const void* grad_out, const void* grad_residual_out, const void* h, const void* weight, void* grad_h,
                  void* grad_h2, void* grad_weight, int64_t rows, int64_t hidden, double eps, DType dtype);

}  // namespace opb::fused_add_rmsnorm
