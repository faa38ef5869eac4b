// fused_add_rmsnorm's CUDA launchers, as the binding sees them: raw pointers, sizes and a stream;
// no torch types. Every buffer is contiguous, 16-byte aligned (cudaErrorMisalignedAddress otherwise)
// and of one dtype. They launch on the current device; the caller selects it. rows, hidden > 0.
#pragma once

#include <cuda_runtime_api.h>
#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::fused_add_rmsnorm {

// input, out: [rows, hidden]; weight: [hidden].
// residual != nullptr: h = input + residual (rounded to dtype) is written to residual_out [rows, hidden].
// residual == nullptr: plain RMSNorm of input (residual_out is not touched).
// out = h * rsqrt(mean(h^2) + eps) * weight, fp32 accumulation (fp64 for Float64).
cudaError_t launch_forward(const void* input, const void* residual, const void* weight, void* out,
                           void* residual_out, int64_t rows, int64_t hidden, double eps, DType dtype,
                           cudaStream_t stream);

// Elements of the workspace launch_backward needs for these sizes on the current device: fp32 for
// Float32/Float16/BFloat16, fp64 for Float64.
int64_t backward_workspace_size(int64_t rows, int64_t hidden, DType dtype);

// grad_out, h (the forward's residual_out, or RMSNorm's input), grad_h: [rows, hidden]; weight,
// grad_weight: [hidden]; grad_residual_out: [rows, hidden] or nullptr (no gradient flows into
// residual_out). workspace: backward_workspace_size() elements, any contents.
// grad_h is the gradient of both input and residual; grad_h2 ([rows, hidden] or nullptr) gets a copy of
// it, written with it.
cudaError_t launch_backward(const void* grad_out, const void* grad_residual_out, const void* h, const void* weight,
                            void* grad_h, void* grad_h2, void* grad_weight, void* workspace, int64_t workspace_size,
                            int64_t rows, int64_t hidden, double eps, DType dtype, cudaStream_t stream);

}  // namespace opb::fused_add_rmsnorm
