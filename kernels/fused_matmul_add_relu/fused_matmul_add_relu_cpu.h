// fused_matmul_add_relu's CPU epilogue, as the binding sees it: the GEMM itself is ATen's.
#pragma once

#include <cstdint>

#include <opbuilder/dtype.h>

namespace opb::fused_matmul_add_relu {

// out[b, r, c] = relu(out[b, r, c] + bias[b * bias_sb + r * bias_sr + c * bias_sc]), in place.
// out: [batch, rows, cols] contiguous. bias: same dtype, strides in elements (0 broadcasts a dim),
// or nullptr for relu alone. NaN passes through, as torch.relu does.
void bias_relu_cpu(void* out, const void* bias, int64_t batch, int64_t rows, int64_t cols, int64_t bias_sb,
                   int64_t bias_sr, int64_t bias_sc, DType dtype);

// The backward's ReLU and bias terms in one pass: for [rows, cols] contiguous grad and out,
// grad_pre = threshold_backward(grad, out, 0) and grad_bias[c] = sum over rows of grad_pre[:, c]
// (accumulated in float, double for double; the same result at any thread count).
void relu_bias_backward_cpu(const void* grad, const void* out, void* grad_pre, void* grad_bias, int64_t rows,
                            int64_t cols, DType dtype);

}  // namespace opb::fused_matmul_add_relu
